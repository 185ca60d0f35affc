"""The latency model (matrixpool.serving.latency): the published operating points hold, TPOT
grows with batch and context, KV bytes follow the MLA derivation, transfers and scaling."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from matrixpool.serving import latency

MODEL = latency.DEFAULT
CONTEXT = latency.REFERENCE_CONTEXT_TOKENS


@pytest.mark.parametrize("cards", [1, 4, 16])
def test_the_operating_batch_yields_the_published_decode_rate_under_50_ms(cards: int) -> None:
    batch = MODEL.operating_batch(cards)
    tpot = MODEL.decode_step_seconds(batch, batch * CONTEXT, cards)
    per_card = MODEL.decode_tokens_per_s(batch, batch * CONTEXT, cards) / cards
    assert batch == 96 * cards
    assert tpot < latency.TPOT_LIMIT_S
    assert per_card == pytest.approx(1_943, rel=0.005)


def test_the_low_latency_point_holds_too() -> None:
    """538 tokens/s per card under 15 ms: the batch that fits in 15 ms yields about that."""
    batch = 8
    assert MODEL.decode_step_seconds(batch, batch * CONTEXT, 1) < latency.LOW_LATENCY_TPOT_S
    assert MODEL.decode_tokens_per_s(batch, batch * CONTEXT, 1) == pytest.approx(538, rel=0.02)


def test_prefill_runs_at_the_published_rate_per_card() -> None:
    assert MODEL.prefill_seconds(6_688, 1) == pytest.approx(1.0)
    assert MODEL.prefill_seconds(6_688 * 8, 8) == pytest.approx(1.0)
    assert MODEL.prefill_seconds(0, 1) == 0


@given(
    batch=st.integers(1, 400),
    context=st.integers(1, 32_768),
    cards=st.integers(1, 16),
)
def test_tpot_grows_with_batch_and_context(batch: int, context: int, cards: int) -> None:
    step = MODEL.decode_step_seconds(batch, batch * context, cards)
    assert MODEL.decode_step_seconds(batch + 1, (batch + 1) * context, cards) > step
    assert MODEL.decode_step_seconds(batch, batch * (context + 1), cards) > step
    assert MODEL.decode_step_seconds(batch, batch * context, cards + 1) < step


def test_a_long_context_breaks_the_50_ms_bound_at_the_operating_batch() -> None:
    batch = MODEL.operating_batch(1)
    assert MODEL.decode_step_seconds(batch, batch * 4 * CONTEXT, 1) > latency.TPOT_LIMIT_S


def test_kv_bytes_per_token_follow_the_mla_derivation() -> None:
    assert latency.KV_BYTES_PER_TOKEN == 61 * (512 + 64) * 1 == 35_136
    assert MODEL.kv_bytes(1_000) == 35_136_000
    assert MODEL.kv_capacity_tokens(2) == 2 * 32 * 10**9 // 35_136


def test_a_remote_block_takes_longer_than_a_local_one() -> None:
    nbytes = MODEL.kv_bytes(4_096)
    local = MODEL.transfer_seconds(nbytes, remote=False)
    remote = MODEL.transfer_seconds(nbytes, remote=True)
    assert local == pytest.approx(10e-6 + nbytes / 160e9)
    assert remote > local
    assert MODEL.transfer_seconds(0, remote=True) == 0


def test_fetching_a_cached_prompt_is_far_cheaper_than_prefilling_it() -> None:
    """The point of the KV pool: 4K tokens' blocks come in ~1 ms, their prefill takes ~0.6 s."""
    fetch = MODEL.transfer_seconds(MODEL.kv_bytes(CONTEXT), remote=True)
    assert fetch * 100 < MODEL.prefill_seconds(CONTEXT, 1)


def test_a_scaled_model_is_faster_by_the_factor() -> None:
    fast = MODEL.scaled(100)
    assert fast.prefill_seconds(1_000, 2) == pytest.approx(MODEL.prefill_seconds(1_000, 2) / 100)
    step = MODEL.decode_step_seconds(10, 40_000, 2)
    assert fast.decode_step_seconds(10, 40_000, 2) == pytest.approx(step / 100)
    nbytes = MODEL.kv_bytes(100)
    assert fast.transfer_seconds(nbytes, True) == pytest.approx(
        MODEL.transfer_seconds(nbytes, True) / 100
    )
    assert fast.operating_batch(1) == MODEL.operating_batch(1)


@pytest.mark.parametrize(
    "call",
    [
        lambda: MODEL.prefill_seconds(10, 0),
        lambda: MODEL.decode_step_seconds(0, 0, 1),
        lambda: MODEL.kv_capacity_tokens(0),
        lambda: MODEL.scaled(0),
    ],
    ids=["prefill on no card", "an empty decode step", "capacity of no card", "a zero speed"],
)
def test_nonsense_is_refused(call: Callable[[], object]) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - the messages are for people
        call()


def test_the_module_functions_are_the_default_model() -> None:
    assert latency.prefill_seconds(100, 1) == MODEL.prefill_seconds(100, 1)
    assert latency.decode_step_seconds(3, 300, 1) == MODEL.decode_step_seconds(3, 300, 1)
    assert latency.kv_bytes(3) == MODEL.kv_bytes(3)
    assert latency.transfer_seconds(10, False) == MODEL.transfer_seconds(10, False)
