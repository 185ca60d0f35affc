"""What the KV pool holds for llama.cpp (issue 33, item 4): slot files read by their header,
references to them under the earlier blocks' hashes, the look-up order and the slot choice.
The proxy on real engines and daemons: tests/checkpoint/test_kv_pool_llamacpp.py."""

from __future__ import annotations

import struct

import pytest

from matrixpool.serving import kvslots

B = kvslots.BLOCK_TOKENS


def slot_file(tokens: list[int], packed: bool = True, kv: bytes = b"KV") -> bytes:
    """A slot file as llama-server writes it: the server's packed token state, or the plain
    list of older servers, then the KV."""
    body = [kvslots.PACKED, 1, len(tokens), *tokens, 0] if packed else tokens
    header = struct.pack("<III", kvslots.MAGIC, kvslots.VERSION, len(body))
    return header + struct.pack(f"<{len(body)}i", *body) + kv


PROMPT = list(range(3, 3 + 3 * B + 10))  # three whole blocks and a tail


@pytest.mark.parametrize("packed", [True, False], ids=["packed state", "plain token list"])
def test_a_slot_files_tokens_are_read_from_its_header(packed: bool) -> None:
    assert kvslots.tokens_of(slot_file(PROMPT, packed)) == tuple(PROMPT)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="nothing"),
        pytest.param(b"GGUF" + bytes(20), id="another file"),
        pytest.param(slot_file(PROMPT)[:40], id="a file cut short"),
        pytest.param(kvslots.reference("ab" * 16), id="a reference"),
    ],
)
def test_anything_but_a_slot_file_has_no_tokens(data: bytes) -> None:
    assert kvslots.tokens_of(data) is None


def test_a_reference_names_a_hash_and_nothing_else_is_one() -> None:
    target = kvslots.hashes(PROMPT)[-1]
    assert kvslots.referenced(kvslots.reference(target)) == target
    assert kvslots.referenced(slot_file(PROMPT)) is None
    assert kvslots.referenced(kvslots.REFERENCE + b"../../etc/passwd") is None


def finds(
    stored: int, covers: dict[int, int] | None = None, floor: int = 0
) -> tuple[list[int], str | None]:
    """Bisect over 16 blocks, the slot holding ``floor``, for a pool holding the first
    ``stored``; the probes made and the find."""
    probed: list[int] = []

    def probe(k: int) -> tuple[str, int] | None:
        probed.append(k)
        return (f"file at {k}", (covers or {}).get(k, k)) if k <= stored else None

    return probed, kvslots.search(floor, 16, probe)


@pytest.mark.parametrize("stored", range(17), ids=lambda n: f"{n} blocks stored")
def test_bisection_finds_the_longest_prefix_stored_in_a_few_probes(stored: int) -> None:
    probed, found = finds(stored)
    assert found == (f"file at {stored}" if stored else None)
    assert len(probed) <= 5  # log2(16) + 1, not 16


def test_a_find_covering_more_blocks_moves_the_search_past_them() -> None:
    probed, found = finds(12, covers={9: 12})  # block 9's reference names a 12-block file
    assert (probed, found) == ([9, 15, 14, 13], "file at 9")


def test_blocks_the_slot_holds_are_not_looked_up() -> None:
    assert finds(16, floor=15) == ([16], "file at 16")
    assert finds(16, floor=16) == ([], None)


def test_a_slot_file_counts_only_when_it_agrees_with_the_prompt_over_the_blocks_named() -> None:
    other_tail = PROMPT[: 2 * B] + [1] * 50  # shares exactly two blocks
    assert kvslots.reuses(slot_file(other_tail), PROMPT, 2) == 2 * B
    assert kvslots.reuses(slot_file(other_tail), PROMPT, 3) == 0
    assert kvslots.reuses(slot_file([*PROMPT, 7, 7]), PROMPT, 3) == len(PROMPT)
    assert kvslots.reuses(b"not a slot file", PROMPT, 1) == 0


def test_the_file_goes_under_the_last_block_and_references_under_the_ones_the_pool_lacked() -> None:
    hashes = kvslots.hashes(PROMPT)
    assert kvslots.to_store(hashes, 1) == [
        kvslots.Entry(hashes[2], 3 * B, None),
        kvslots.Entry(hashes[1], 2 * B, hashes[2]),
    ]
    assert [e.block_hash for e in kvslots.to_store(hashes, 0)] == [hashes[2], hashes[0], hashes[1]]
    assert kvslots.to_store(hashes, 3) == []


def test_a_request_takes_the_free_slot_holding_most_of_its_prompt() -> None:
    slots = kvslots.Slots.of(3)
    first, second = slots.take(PROMPT), slots.take(PROMPT)
    assert first is not None
    assert second is not None
    slots.give_back(first, PROMPT[:B])
    slots.give_back(second, PROMPT[: 2 * B])

    assert slots.take(PROMPT) is second
    assert slots.take(PROMPT) is first
    assert slots.take(PROMPT) is not None  # the third, empty
    assert slots.take(PROMPT) is None  # all busy


def test_among_slots_holding_nothing_of_the_prompt_the_least_recently_used() -> None:
    slots = kvslots.Slots.of(2)
    first, second = slots.take([]), slots.take([])
    assert first is not None
    assert second is not None
    slots.give_back(second, PROMPT)
    slots.give_back(first, PROMPT)
    assert slots.take([1, 2, 3]) is first  # taken before the other


def test_an_engine_has_at_least_one_slot() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        kvslots.Slots.of(0)
