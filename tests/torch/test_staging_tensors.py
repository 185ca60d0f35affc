"""Staging of real CPU tensors: captured by copy (a tensor cannot be made read-only, and an
optimizer step writes it in place right after ``save`` returns), restored into the caller's
own tensors."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest

from matrixpool_recovery import CheckpointSpec, staging
from tests.checkpoint.conftest import Cluster
from tests.torch.conftest import require

torch = require("torch")


def shard_of(state: dict[str, Any], mutate: Any = None) -> tuple[bytes, str]:
    captured = staging.Stager().capture("job", 0, 1, state)
    if mutate is not None:
        mutate()  # the trainer goes on before the background thread copies
    dest = np.empty(captured.layout.size, dtype=np.uint8)
    digest = staging.write_shard(captured, dest)
    captured.release()
    return dest.tobytes(), digest


def read(data: bytes, digest: str, into: dict[str, Any] | None = None) -> dict[str, Any]:
    _, state = staging.read_shard(io.BytesIO(data).readinto, len(data), digest, into)
    return state


def test_a_tensor_written_in_place_after_capture_is_saved_as_it_was_captured() -> None:
    weights = torch.arange(1000, dtype=torch.float32)
    before = weights.clone()
    data, digest = shard_of({"w": weights}, mutate=lambda: weights.add_(1.0))
    assert torch.equal(read(data, digest)["w"], before)


def test_a_tensor_stepped_right_after_save_is_checkpointed_as_saved(cluster: Cluster) -> None:
    """Through a daemon: save() returns, the trainer steps at once (no wait_staged), the
    shard holds the tensor of the step saved."""
    cluster.start("a")
    weights = torch.zeros(8 << 20, dtype=torch.float32)  # 32 MB: copied well after save()
    spec = CheckpointSpec(memory_every=1, peer_replicas=0)
    with cluster.client("a", "ml.cpu-tensor", 0, 1, spec=spec) as client:
        for step in (1, 2, 3):
            handle = client.save(step, {"w": weights})
            weights.add_(1.0)  # optimizer.step()
            handle.wait()
            restored = client.restore(step)
            assert torch.equal(restored.state["w"], torch.full_like(weights, step - 1))


def test_a_restore_fills_a_models_parameters_in_place() -> None:
    torch.manual_seed(0)
    saved = torch.nn.Linear(16, 8)
    data, digest = shard_of(dict(saved.named_parameters()))
    model = torch.nn.Linear(16, 8)
    into = dict(model.named_parameters())  # leaves that require grad
    restored = read(data, digest, into)
    assert restored["weight"] is into["weight"]
    assert torch.equal(model.weight, saved.weight)
    assert torch.equal(model.bias, saved.bias)


@pytest.mark.parametrize(
    "tensor",
    [
        pytest.param(torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), id="bfloat16"),
        pytest.param(torch.tensor(7.5), id="a 0-d tensor"),
        pytest.param(torch.tensor([True, False, True]), id="bool"),
        pytest.param(torch.arange(20, dtype=torch.int64).reshape(4, 5).t(), id="a transposed"),
        pytest.param(torch.zeros(0, 3), id="an empty tensor"),
    ],
)
def test_tensors_round_trip_with_their_dtype_and_shape(tensor: Any) -> None:
    data, digest = shard_of({"t": tensor})
    restored = read(data, digest)["t"]
    assert restored.dtype == tensor.dtype
    assert restored.shape == tensor.shape
    assert torch.equal(restored, tensor)


def test_a_capture_reuses_its_host_buffers() -> None:
    stager = staging.Stager()
    weights = torch.ones(256)
    first = stager.capture("job", 0, 1, {"w": weights}).views[0]
    second = stager.capture("job", 0, 2, {"w": weights}).views[0]
    assert first.ctypes.data == second.ctypes.data


def test_cuda_tensors_go_through_torch_cuda() -> None:
    module = staging.device_module(torch.device("cuda", 0))
    assert module is torch.cuda
    assert staging.has_streams(module)
