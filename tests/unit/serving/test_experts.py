"""The simulated server's experts (matrixpool.serving.experts and the server's counters): a
skewed, seeded gate; tokens counted per expert on /metrics as
``matrixpool_serving_expert_tokens_total{expert="7"}``; the per-card load following the
mounted expert map, which is read again when the kubelet rewrites it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from matrixpool.placement import eplb
from matrixpool.serving import __main__ as entry
from matrixpool.serving import engine, experts, server
from tests.unit.serving.test_server import FAST, HeldClock, body, run, samples


def write_map(path: Path, layout: list[int]) -> None:
    """An instance's expert map as the operator writes it (one pod of len(layout) cards)."""
    entries = [{"expert": s, "copyOf": e, "pod": "p-0", "card": s} for s, e in enumerate(layout)]
    path.write_text(json.dumps(entries))


def routed_app(
    clock: HeldClock, count: int, skew: float, top_k: int, map_file: Path | None = None
) -> Any:
    shares = experts.zipf_shares(count, skew, seed=3)
    routed = experts.Experts(experts.Router(shares, top_k), experts.MapFile(map_file, count))
    instance = engine.Engine(model=FAST)
    return server.create_app(instance, model_name="m", clock=clock, routed=routed)


async def served(client: Any, clock: HeldClock, prompt: int, max_tokens: int) -> None:
    """One request answered, the held clock moved a second at a time until it is."""
    payload = body(prompt=[1] * prompt, max_tokens=max_tokens)
    answer = asyncio.create_task(client.post("/v1/completions", json=payload))
    while not answer.done():
        await asyncio.sleep(0.001)
        clock.now += 1.0
        client.app[server.STATE].wake()
    assert (await answer).status == 200


def by_label(found: dict[str, float], metric: str, label: str) -> dict[int, float]:
    prefix = f"{metric}{{{label}="
    return {int(k[len(prefix) : -1]): v for k, v in found.items() if k.startswith(prefix)}


# --- the gate ---------------------------------------------------------------------------------
def test_no_skew_is_an_even_gate_and_a_skew_makes_a_seeded_few_hot() -> None:
    assert experts.zipf_shares(4, 0.0) == (0.25, 0.25, 0.25, 0.25)
    skewed = experts.zipf_shares(64, 1.2, seed=1)
    assert sum(skewed) == pytest.approx(1.0)
    assert max(skewed) / min(skewed) == pytest.approx(64**1.2)
    assert skewed != experts.zipf_shares(64, 1.2, seed=2)  # other experts are the hot ones
    assert sorted(skewed) == sorted(experts.zipf_shares(64, 1.2, seed=2))


def test_the_gate_counts_whole_tokens_and_carries_the_fractions() -> None:
    router = experts.Router(experts.zipf_shares(3, 0.0), top_k=2)
    first = router.route(1)  # 2/3 of a token each: none whole yet
    assert first == [0, 0, 0]
    counted = [sum(column) for column in zip(*(router.route(1) for _ in range(2)), strict=True)]
    assert counted == [2, 2, 2]  # 3 tokens, 2 experts each: 6 routed


# --- the map file -----------------------------------------------------------------------------
def test_the_map_is_read_again_when_its_file_changes_at_most_every_second(tmp_path: Path) -> None:
    path = tmp_path / "decode-0.json"
    follows = experts.MapFile(path, 2)
    assert not follows.poll(0.0)  # not written yet: an optional ConfigMap
    write_map(path, [0, 1, 0])
    assert not follows.poll(0.5)  # looked at 0.0: not due
    assert follows.poll(1.0)
    assert follows.layout == (0, 1, 0)
    write_map(path, [0, 1, 1])
    path.with_suffix(".tmp").write_text("")
    assert follows.poll(2.0)
    assert follows.layout == (0, 1, 1)
    path.write_text("[{not json")  # a torn write: the last good map stays
    assert not follows.poll(3.0)
    assert follows.layout == (0, 1, 1)


@pytest.mark.parametrize(
    "text",
    ["[]", '[{"expert": 0, "copyOf": 0}, {"expert": 1, "copyOf": 0}]', '{"expert": 0}',
     '[{"expert": 0, "copyOf": 0}, {"expert": 2, "copyOf": 1}]'],
    ids=["empty", "an expert missing", "no list", "a slot missing"],
)  # fmt: skip
def test_a_map_that_does_not_fit_the_experts_is_not_taken(text: str) -> None:
    assert experts.read_layout(text, 2) is None


# --- the server -------------------------------------------------------------------------------
def test_metrics_count_the_tokens_routed_to_each_expert() -> None:
    """4 experts, 2 per token, no skew: each expert gets half of every token."""
    clock = HeldClock()

    async def scenario(client: Any) -> None:
        found = samples(await (await client.get("/metrics")).text())
        assert by_label(found, experts.EXPERT_TOKENS, "expert") == {0: 0, 1: 0, 2: 0, 3: 0}
        for _ in range(2):
            await served(client, clock, 10, 4)
        text = await (await client.get("/metrics")).text()
        assert experts.tokens_per_expert(text) == {0: 14, 1: 14, 2: 14, 3: 14}

    run(routed_app(clock, 4, 0.0, 2), scenario)


def test_the_load_per_card_follows_the_map_and_its_reload(tmp_path: Path) -> None:
    """A skewed gate on the first map, then on a balanced one written while the server runs:
    max/mean per card falls by the plan's figure, no restart."""
    clock, path = HeldClock(), tmp_path / "decode-0.json"
    count, slots = 8, 12
    write_map(path, list(eplb.default_layout(count, slots)))

    async def load(client: Any) -> dict[int, float]:
        before = by_label(
            samples(await (await client.get("/metrics")).text()), experts.SLOT_TOKENS, "slot"
        )
        for _ in range(20):
            await served(client, clock, 200, 1)
        after = by_label(
            samples(await (await client.get("/metrics")).text()), experts.SLOT_TOKENS, "slot"
        )
        return {s: after[s] - before.get(s, 0.0) for s in after}

    async def scenario(client: Any) -> None:
        first = await load(client)
        routed = client.app[server.STATE].experts
        assert routed is not None
        expert_load = [share * 4000 for share in routed.router.shares]
        balanced = eplb.plan(expert_load, slots, 4)
        write_map(path, list(balanced.layout))
        second = await load(client)
        assert eplb.imbalance(list(first.values())) == pytest.approx(
            eplb.evaluate(expert_load, eplb.default_layout(count, slots), 4).imbalance, rel=0.02
        )
        assert eplb.imbalance(list(second.values())) == pytest.approx(balanced.imbalance, rel=0.02)
        assert eplb.imbalance(list(second.values())) < 0.7 * eplb.imbalance(list(first.values()))

    run(routed_app(clock, count, 1.2, 1, path), scenario)


def test_an_instance_without_experts_exports_no_expert_series() -> None:
    text = server.Metrics("m").text().decode()
    assert experts.tokens_per_expert(text) == {}
    assert experts.tokens_per_expert("not prometheus {") == {}


def test_the_pods_environment_gives_the_experts_and_the_map() -> None:
    environ = {"MATRIXPOOL_EXPERTS": "288", "MATRIXPOOL_EXPERT_MAP_FILE": "/etc/x/decode-0.json"}
    args = entry.parser(environ).parse_args(["--expert-skew", "1.1"])
    assert (args.experts, args.expert_map, args.expert_skew) == (
        288,
        Path("/etc/x/decode-0.json"),
        1.1,
    )
    routed = entry.routed(args)
    assert routed is not None
    assert routed.router.top_k == experts.DEFAULT_TOP_K
    assert entry.routed(entry.parser({}).parse_args([])) is None
