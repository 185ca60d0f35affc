"""The real PyTorch trainer: two gloo ranks as processes, checkpointed through real daemons,
killed and restored, ending with exactly the parameters of a run that was never interrupted."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest

from matrixpool.api import labels
from matrixpool_recovery import restore as restore_codec
from tests.checkpoint.conftest import Cluster
from tests.torch.conftest import WIDTH, Job, Rank, annotate, require, wait_until

torch = require("torch")
dcp = require("torch.distributed.checkpoint")
torch_trainer = require("matrixpool.devcluster.torch_trainer")

STEPS = 24  # every run ends here
SPEC = {"memory": {"everySteps": 4, "peerReplicas": 1}, "local": {"everySteps": 8}}
PAUSE = 0.15  # seconds per step of the runs a test kills, so it can kill them mid-run
FIRST, SECOND = 1_000, 2_000  # incarnations: the first run, the run after the recovery

# The trainer's float(loss) of a tensor that requires grad warns since torch 2.5; the in-process
# reference runs that code here, where warnings are errors. The trainer is left as it is.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Converting a tensor with requires_grad=True to a scalar:UserWarning"
)


@functools.cache
def reference(steps: int = STEPS, world: int = 2) -> str:
    """The digest of a fault-free run, computed in this process (one replica, ranks in turn)."""
    return str(torch_trainer.reference_digest(steps, world, torch_trainer.Settings(width=WIDTH)))


def digests(ranks: list[Rank]) -> set[str]:
    return {rank.finish()["digest"] for rank in ranks}


def test_two_ranks_end_with_the_digest_of_the_in_process_reference(
    new_job: Callable[..., Job],
) -> None:
    job = new_job("ml.torch-plain", STEPS, SPEC)
    ranks = [job.launch(rank, FIRST) for rank in range(2)]
    assert digests(ranks) == {reference()}
    assert ranks[0].seen(step=0, restored=None)
    assert job.committed() == STEPS  # the last step is due on tier 1 (every 4)


def test_a_gang_killed_after_a_checkpoint_resumes_as_a_new_incarnation_bitwise(
    new_job: Callable[..., Job], daemons: Cluster
) -> None:
    """Both ranks SIGKILLed; the new incarnation restores the newest committed step (what the
    operator's Reschedule does) and ends as if nothing happened. The new rank 0 serves the
    store at the same MASTER_ADDR:MASTER_PORT the killed one did."""
    daemons.persistent.mkdir(parents=True, exist_ok=True)
    tier3 = {"everySteps": 8, "uri": f"file://{daemons.persistent}"}
    job = new_job("ml.torch-gang", STEPS, {**SPEC, "persistent": tier3})
    first = [job.launch(rank, FIRST, PAUSE) for rank in range(2)]
    wait_until(lambda: (job.committed() or 0) >= 8, "step 8 committed")
    for rank in first:
        rank.kill()
    step = job.committed()
    assert step is not None
    assert 8 <= step < STEPS
    value = restore_codec.restore_value(step, recovery_id="r1", incarnation=SECOND, of=FIRST)
    for rank in range(2):
        job.restore(rank, value)
    second = [job.launch(rank, SECOND) for rank in range(2)]
    assert digests(second) == {reference()}
    for rank in second:
        assert rank.seen(restored=step, recovery="r1")
        assert not rank.seen(step=1)  # nothing was trained again from the start


def test_a_rank_killed_alone_is_replaced_and_the_survivor_reloads_in_place(
    new_job: Callable[..., Job],
) -> None:
    """InPlace with gloo: the dead rank breaks the survivor's collective; the survivor (same
    process) waits for the restore annotation, leaves the broken group, joins the new
    incarnation's with the replacement, and both reload the committed step."""
    job = new_job("ml.torch-inplace", STEPS, SPEC)
    survivor, victim = (job.launch(rank, FIRST, PAUSE) for rank in range(2))
    wait_until(lambda: (job.committed() or 0) >= 8, "step 8 committed")
    victim.kill()
    wait_until(lambda: survivor.seen(broken=None), "the survivor's collective breaks")
    step = job.committed()
    assert step is not None
    assert 8 <= step < STEPS
    value = restore_codec.restore_value(step, recovery_id="r2", incarnation=SECOND, of=FIRST)
    job.restore(0, value)  # the surviving pod's annotation changes
    job.restore(1, value)  # the new pod is created with it
    replacement = job.launch(1, SECOND, PAUSE)
    assert digests([survivor, replacement]) == {reference()}
    assert survivor.seen(restored=step, recovery="r2")
    assert replacement.seen(restored=step, recovery="r2")


def test_a_checkpoint_request_is_answered_by_both_ranks_at_one_step(
    new_job: Callable[..., Job],
) -> None:
    """The first rank to see the request picks the step and publishes it through the gang's
    store; both save it on every configured tier."""
    job = new_job("ml.torch-request", 12, {"memory": {"everySteps": 100, "peerReplicas": 1}})
    ranks = [job.launch(rank, FIRST, 0.1) for rank in range(2)]
    wait_until(lambda: all(r.seen(step=2) for r in ranks), "both ranks at step 2")
    for rank in range(2):
        annotate(job.annotations(rank), {labels.CHECKPOINT_REQUEST: "req-1"})
    answers = [wait_until(lambda r=r: r.seen(answered="req-1"), "an answer") for r in ranks]
    assert answers[0]["step"] == answers[1]["step"]
    assert digests(ranks) == {reference(12)}
    assert job.committed() == answers[0]["step"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process
def test_model_and_optimizer_state_round_trip_bitwise_through_dcp(tmp_path: Path) -> None:
    """In-process: 3 steps, ``dcp.save`` of ``state_of``, a fresh model and optimizer loaded
    from it, 2 more steps: the digest of 5 fault-free steps (Adam's moments and step counters
    are in the state). DCP's own file storage: the trainer's state, not the tiers, is tested."""
    settings = torch_trainer.Settings(width=64)
    with torch_trainer.deterministic():
        model = torch_trainer.model_for(settings)
        optimizer = torch_trainer.optimizer_for(model)
        for step in (1, 2, 3):
            gradient = torch_trainer.local_gradient(model, settings, step, 0)[0]
            torch_trainer.apply(model, optimizer, gradient)
        state = torch_trainer.state_of(model, optimizer)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
        fresh = torch_trainer.model_for(torch_trainer.Settings(seed=9, width=64))
        fresh_optimizer = torch_trainer.optimizer_for(fresh)
        into = torch_trainer.state_of(fresh, fresh_optimizer)
        dcp.load(into, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
        torch_trainer.load(fresh, fresh_optimizer, into)
        for step in (4, 5):
            gradient = torch_trainer.local_gradient(fresh, settings, step, 0)[0]
            torch_trainer.apply(fresh, fresh_optimizer, gradient)
        assert torch_trainer.digest(fresh) == torch_trainer.reference_digest(5, 1, settings)


def test_a_rank_without_master_addr_fails_naming_the_variable() -> None:
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        torch_trainer.Master.from_env({"MASTER_PORT": "29500"}, 1, 2)
    with pytest.raises(ValueError, match="RANK=2 is not the job's 1"):
        torch_trainer.Master.from_env({"MASTER_ADDR": "a", "RANK": "2"}, 1, 2)
    env = {"MASTER_ADDR": "a", "RANK": "1", "WORLD_SIZE": "2"}
    assert torch_trainer.Master.from_env(env, 1, 2) == torch_trainer.Master("a", 29500)
