"""The trainer client without a daemon: arguments, environment, cadence."""

from __future__ import annotations

from pathlib import Path

import pytest

from matrixpool_recovery import Checkpointer, CheckpointSpec, errors


def test_the_client_is_built_from_what_the_operator_puts_in_the_pod(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    env = {
        "MATRIXPOOL_JOB": "ml.llm",
        "MATRIXPOOL_RANK": "3",
        "MATRIXPOOL_WORLD_SIZE": "8",
        "MATRIXPOOL_CKPT_DAEMON": "10.0.0.7:7040",
        "MATRIXPOOL_CKPT_TOKEN_FILE": str(token),
        "MATRIXPOOL_CKPT_PEERS": "10.0.1.1:7040,10.0.1.2:7040",
        "MATRIXPOOL_CHECKPOINT": '{"memory": {"everySteps": 10}, "local": {"everySteps": 50}}',
    }
    client = Checkpointer.from_env(env)
    assert (client.job, client.rank, client.world_size) == ("ml.llm", 3, 8)
    assert client.daemon.token == "s3cret"
    assert client.daemon.host_port == ("10.0.0.7", 7040)
    assert client.spec.due(50) == ("memory", "local")


def test_a_save_due_nowhere_is_done_at_once() -> None:
    with Checkpointer("job", 0, 1, "127.0.0.1:9", "t", spec=CheckpointSpec(10)) as client:
        handle = client.save(7, {"w": b"x"})
        assert handle.done.is_set()
        assert handle.wait() == {}


def test_a_save_to_an_unreachable_daemon_fails_on_every_tier_it_asked_for() -> None:
    spec = CheckpointSpec(memory_every=1, local_every=1)
    # a short wait for the daemon: the default (120 s) is tests/checkpoint's to show
    with Checkpointer("job", 0, 1, "127.0.0.1:9", "t", spec=spec, daemon_wait=0.5) as client:
        handle = client.save(1, {"w": b"x"})
        with pytest.raises(errors.TierWriteError, match="unreachable") as raised:
            handle.wait()
    assert set(raised.value.failures) == {"memory", "local"}


@pytest.mark.parametrize(
    ("rank", "world"), [(-1, 2), (2, 2)], ids=["a negative rank", "a rank past the world"]
)
def test_a_rank_outside_the_world_is_refused(rank: int, world: int) -> None:
    with pytest.raises(errors.InvalidNameError):
        Checkpointer("job", rank, world, "127.0.0.1:9", "t")


def test_an_unreachable_daemon_is_named_when_nothing_can_be_restored() -> None:
    client = Checkpointer("job", 0, 1, "127.0.0.1:9", "t", peers=["127.0.0.1:7"])
    with pytest.raises(errors.NoCheckpointError, match=r"unreachable daemons: 127\.0\.0\.1:9; "):
        client.restore()
