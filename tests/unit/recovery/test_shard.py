"""Shard bytes: capture, copy with hashing, read back with verification."""

from __future__ import annotations

import io
import sys
from typing import Any

import numpy as np
import pytest

from matrixpool_recovery import checksum, errors, shard, staging


def sample() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {
        "weights": rng.standard_normal((33, 17)).astype(np.float32),
        "counts": np.arange(10, dtype=">i8"),
        "scalar": np.array(3.5),
        "empty": np.zeros((0, 4), dtype=np.int16),
        "meta": b"step 7",
        "bytearray": bytearray(b"ab"),
    }


def staged(state: dict[str, Any], algorithm: str = checksum.DEFAULT) -> tuple[bytes, str]:
    captured = staging.Stager().capture("job", 3, 7, state)
    dest = np.empty(captured.layout.size, dtype=np.uint8)
    digest = staging.write_shard(captured, dest, algorithm)
    captured.release()
    return dest.tobytes(), digest


def read_back(data: bytes, digest: str, into: dict[str, Any] | None = None) -> dict[str, Any]:
    stream = io.BytesIO(data)
    _, state = staging.read_shard(stream.readinto, len(data), digest, into)
    return state


def assert_same(restored: dict[str, Any], original: dict[str, Any]) -> None:
    assert restored.keys() == original.keys()
    for name, value in original.items():
        if isinstance(value, bytes | bytearray):
            assert restored[name] == bytes(value)
        else:
            assert restored[name].dtype == value.dtype
            assert restored[name].shape == value.shape
            assert np.array_equal(restored[name], value)


@pytest.mark.parametrize("algorithm", [checksum.XXH3, checksum.CRC32])
def test_a_state_round_trips_through_shard_bytes(algorithm: str) -> None:
    state = sample()
    data, digest = staged(state, algorithm)
    assert digest == checksum.of(data, algorithm)
    assert data[: len(shard.MAGIC)] == shard.MAGIC
    assert_same(read_back(data, digest), state)


def test_a_restore_fills_the_callers_arrays_in_place() -> None:
    state = sample()
    data, digest = staged(state)
    into = {k: np.zeros_like(v) for k, v in state.items() if isinstance(v, np.ndarray)}
    restored = read_back(data, digest, into)
    assert restored["weights"] is into["weights"]
    assert_same(restored, state)


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda d: d[:100] + bytes([d[100] ^ 1]) + d[101:], id="a flipped bit"),
        pytest.param(lambda d: d[:-1], id="a missing last byte"),
        pytest.param(lambda d: d + b"\0", id="a byte too many"),
        pytest.param(lambda d: b"X" + d[1:], id="a bad magic"),
        pytest.param(lambda d: d[:4096], id="the header alone"),
    ],
)
def test_a_corrupt_or_partial_shard_is_detected(damage: Any) -> None:
    data, digest = staged(sample())
    broken = damage(data)
    with pytest.raises(errors.IntegrityError):
        read_back(broken, digest) if len(broken) == len(data) else _read_sized(broken, data, digest)


def _read_sized(broken: bytes, data: bytes, digest: str) -> None:
    stream = io.BytesIO(broken)
    staging.read_shard(stream.readinto, len(data), digest)


def test_arrays_are_read_only_while_staged_and_writable_after() -> None:
    weights = np.ones(1000, dtype=np.float32)
    captured = staging.Stager().capture("job", 0, 1, {"w": weights})
    with pytest.raises(ValueError, match="read-only"):
        weights[0] = 2.0
    staging.write_shard(captured, np.empty(captured.layout.size, dtype=np.uint8))
    captured.release()
    weights[0] = 2.0


def test_a_non_contiguous_array_is_copied_at_capture() -> None:
    matrix = np.arange(20, dtype=np.int32).reshape(4, 5)
    data, digest = staged({"column": matrix[:, 1]})
    assert np.array_equal(read_back(data, digest)["column"], matrix[:, 1])
    assert matrix.flags.writeable


@pytest.mark.parametrize(
    "value",
    [np.array([object()]), "a string", 3],
    ids=["an object array", "a str", "an int"],
)
def test_values_that_are_not_bytes_arrays_or_tensors_are_refused(value: Any) -> None:
    with pytest.raises(TypeError):
        staging.Stager().capture("job", 0, 1, {"v": value})


def test_entries_are_aligned_for_views() -> None:
    layout = staging.Stager().capture("job", 0, 1, sample()).layout
    assert layout.payload_start % shard.PAYLOAD_ALIGN == 0
    assert all(e.offset % shard.ENTRY_ALIGN == 0 for e in layout.entries)


def test_tensors_round_trip_where_torch_is_installed_and_torch_is_never_imported_to_save() -> None:
    """torch is optional: without it, saving must not import it; with it, tensors round-trip."""
    torch = sys.modules.get("torch")
    if torch is None:
        staged(sample())
        assert "torch" not in sys.modules
        return
    tensor = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    data, digest = staged({"t": tensor})
    restored = read_back(data, digest)["t"]
    assert restored.dtype == torch.bfloat16
    assert torch.equal(restored, tensor)
