"""benchmarks/locality_wait.py's model: the peers' trace placed by the engine in simulated
time, with and without a locality wait."""

from __future__ import annotations

from benchmarks import locality_wait, peers


def test_a_wait_spreads_fewer_gangs_and_every_gang_is_placed() -> None:
    trace = peers.make_trace(7, 200, 120.0)
    none = locality_wait.run(trace, 0.0)
    ten = locality_wait.run(trace, 10.0)
    assert none["placed"] == ten["placed"] == 200
    assert none["extra_racks"] > 0  # the trace does spread gangs without a wait
    assert ten["extra_racks"] < none["extra_racks"]


def test_no_gang_waits_for_racks_when_it_fits_one() -> None:
    """Gangs of one rack or less never cross racks, waiting or not."""
    trace = [g for g in peers.make_trace(7, 200, 120.0) if g.pods <= 4 and not g.serving]
    assert locality_wait.run(trace, 0.0)["extra_racks"] == 0
    assert locality_wait.run(trace, 10.0) == {**locality_wait.run(trace, 0.0), "wait_seconds": 10.0}


def test_the_sweep_over_seeds_compares_each_wait_with_no_wait_on_the_same_traces() -> None:
    rows = locality_wait.sweep(2, [0.0, 10.0])
    none, ten = rows
    assert none["idle_vs_no_wait_mean"] == none["idle_vs_no_wait_median"] == 1.0
    assert ten["extra_racks_mean"] < none["extra_racks_mean"]
    assert ten["idle_vs_no_wait_mean"] != 1.0  # the wait does change when cards are used
