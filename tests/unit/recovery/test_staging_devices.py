"""Staging of tensors on any device, without torch or an accelerator: a fake torch whose
tensors are NumPy arrays that claim a device, and a fake device module (what ``torch.cuda`` or
``torch.npu`` is to staging) that records its calls and runs a side stream's copies only when
an event of that stream is waited for, as a real device does."""

from __future__ import annotations

import io
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from matrixpool_recovery import staging


@dataclass(frozen=True)
class Device:
    type: str
    index: int = 0


CPU = Device("cpu")
NPU = Device("npu")


@dataclass(frozen=True)
class Dtype:
    name: str
    numpy: Any

    def __str__(self) -> str:
        return f"torch.{self.name}"


UINT8, FLOAT32 = Dtype("uint8", np.uint8), Dtype("float32", np.float32)


class Stream:
    def __init__(self, module: DeviceModule, device: Device) -> None:
        self.module, self.device = module, device
        self.queued: list[Any] = []  # copies not run yet

    def wait_stream(self, other: Stream) -> None:
        self.module.calls.append(("wait_stream", other))


class Event:
    def __init__(self, module: DeviceModule) -> None:
        self.module = module
        self.work: list[Any] = []  # copies recorded, run by synchronize()

    def record(self, stream: Stream) -> None:
        self.module.calls.append(("record", stream))
        self.work, stream.queued = stream.queued, []

    def synchronize(self) -> None:
        self.module.calls.append(("synchronize",))
        for copy in self.work:
            copy()


@dataclass
class DeviceModule:
    """A fake torch.npu: Stream, Event, stream(), current_stream(), all recorded."""

    calls: list[tuple[Any, ...]] = field(default_factory=list)
    active: Stream | None = None  # the stream a `with module.stream(s)` made current
    default: dict[Device, Stream] = field(default_factory=dict)

    def Stream(self, device: Device) -> Stream:  # noqa: N802 (torch's name)
        self.calls.append(("Stream", device))
        return Stream(self, device)

    def Event(self) -> Event:  # noqa: N802
        return Event(self)

    def current_stream(self, device: Device) -> Stream:
        return self.default.setdefault(device, Stream(self, device))

    @contextmanager
    def stream(self, stream: Stream) -> Iterator[None]:
        self.calls.append(("enter", stream))
        self.active = stream
        try:
            yield
        finally:
            self.active = None


class Tensor:
    """A NumPy array that claims a device; .numpy() refuses on a device, as torch does."""

    def __init__(self, array: Any, device: Device, torch: FakeTorch, pinned: bool = False):
        self.array, self.device, self.torch, self.pinned = array, device, torch, pinned

    @property
    def dtype(self) -> Dtype:
        return UINT8 if self.array.dtype == np.uint8 else FLOAT32

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    def _like(self, array: Any, device: Device | None = None) -> Tensor:
        return Tensor(array, device or self.device, self.torch)

    def detach(self) -> Tensor:
        return self

    def contiguous(self) -> Tensor:
        return self

    def is_contiguous(self) -> bool:
        return True

    def reshape(self, *shape: Any) -> Tensor:
        return self._like(self.array.reshape(*shape))

    def view(self, dtype: Dtype) -> Tensor:
        return self._like(self.array.view(dtype.numpy))

    def numel(self) -> int:
        return int(self.array.size)

    def element_size(self) -> int:
        return int(self.array.itemsize)

    def numpy(self) -> Any:
        if self.device.type != "cpu":
            raise TypeError(f"can't convert {self.device.type} tensor to numpy")
        return self.array

    def to(self, device: Any) -> Tensor:
        target = CPU if device == "cpu" else device
        self.torch.calls.append(("to", self.device.type, target.type))
        return self._like(self.array.copy(), target)

    def copy_(self, source: Tensor, non_blocking: bool = False) -> Tensor:
        module = self.torch.npu
        self.torch.calls.append(("copy_", source.device.type, self.device.type, non_blocking))

        def copy() -> None:
            np.copyto(self.array, source.array.reshape(self.array.shape))

        if module.active is not None and non_blocking:
            module.active.queued.append(copy)  # runs when an event of the stream is waited for
        else:
            copy()
        return self

    def record_stream(self, stream: Stream) -> None:
        self.torch.calls.append(("record_stream", stream))


class FakeTorch:
    """What staging uses of the torch module."""

    Tensor = Tensor
    uint8, float32 = UINT8, FLOAT32

    def __init__(self, npu: Any = None, pinning: bool = True) -> None:
        self.npu = DeviceModule() if npu is None else npu  # the device module of "npu"
        self.pinning = pinning  # False: pin_memory=True raises, as with no accelerator
        self.calls: list[tuple[Any, ...]] = []

    def empty(self, count: int, dtype: Dtype, pin_memory: bool = False) -> Tensor:
        self.calls.append(("empty", count, pin_memory))
        if pin_memory and not self.pinning:
            raise RuntimeError("no accelerator to pin memory for")
        return Tensor(np.full(count, 0xEE, dtype=dtype.numpy), CPU, self, pin_memory)

    def from_numpy(self, array: Any) -> Tensor:
        return Tensor(array, CPU, self)

    def tensor(self, values: Any, device: Device = CPU) -> Tensor:
        return Tensor(np.asarray(values, dtype=np.float32), device, self)


@pytest.fixture
def torch(monkeypatch: pytest.MonkeyPatch) -> FakeTorch:
    fake = FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", fake)
    return fake


def stage(stager: staging.Stager, state: dict[str, Any]) -> tuple[bytes, str]:
    captured = stager.capture("job", 0, 1, state)
    dest = np.empty(captured.layout.size, dtype=np.uint8)
    digest = staging.write_shard(captured, dest)
    return dest.tobytes(), digest


def read(data: bytes, digest: str, into: dict[str, Any] | None = None) -> dict[str, Any]:
    _, state = staging.read_shard(io.BytesIO(data).readinto, len(data), digest, into)
    return state


def npu_stager(torch: FakeTorch) -> staging.Stager:
    return staging.Stager(lambda device: torch.npu if device.type == "npu" else None)


def test_a_device_tensor_is_copied_on_a_side_stream_into_a_pinned_buffer(torch: FakeTorch) -> None:
    weights = torch.tensor(np.arange(256), NPU)
    stager = npu_stager(torch)
    captured = stager.capture("job", 0, 1, {"w": weights})
    assert ("empty", 1024, True) in torch.calls
    assert not np.array_equal(captured.views[0].view(np.float32), weights.array)  # in flight
    [stream] = [call[1] for call in torch.npu.calls if call[0] == "enter"]
    assert torch.npu.calls[:3] == [
        ("Stream", NPU),
        ("wait_stream", torch.npu.current_stream(NPU)),  # after the trainer's queued work
        ("enter", stream),
    ]
    assert ("copy_", "npu", "cpu", True) in torch.calls
    assert ("record_stream", stream) in torch.calls
    captured.ready()
    assert np.array_equal(captured.views[0].view(np.float32), weights.array)


def test_writing_a_shard_waits_for_the_device_copies(torch: FakeTorch) -> None:
    weights = torch.tensor(np.linspace(0, 1, 100), NPU)
    data, digest = stage(npu_stager(torch), {"w": weights})
    assert ("synchronize",) in torch.npu.calls
    restored = read(data, digest)["w"]
    assert restored.device == CPU
    assert np.array_equal(restored.array, weights.array)


def test_the_side_stream_and_the_pinned_buffer_serve_every_save(torch: FakeTorch) -> None:
    stager = npu_stager(torch)
    weights = torch.tensor(np.zeros(64), NPU)
    first = stager.capture("job", 0, 1, {"w": weights})
    first.ready()
    second = stager.capture("job", 0, 2, {"w": weights})
    assert [c for c in torch.npu.calls if c[0] == "Stream"] == [("Stream", NPU)]
    assert [c for c in torch.calls if c[0] == "empty"] == [("empty", 256, True)]
    assert first.views[0].ctypes.data == second.views[0].ctypes.data


def test_a_device_module_without_streams_is_copied_with_to_cpu(torch: FakeTorch) -> None:
    stager = staging.Stager(lambda device: SimpleNamespace())  # e.g. torch.mps: no Stream
    weights = torch.tensor([1.0, 2.0, 3.0], NPU)
    data, digest = stage(stager, {"w": weights})
    assert ("to", "npu", "cpu") in torch.calls
    assert np.array_equal(read(data, digest)["w"].array, weights.array)


def test_a_device_without_pinned_memory_stages_through_pageable_memory(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeTorch(pinning=False)
    monkeypatch.setitem(sys.modules, "torch", fake)
    weights = fake.tensor([4.0, 5.0], NPU)
    data, digest = stage(npu_stager(fake), {"w": weights})
    assert ("empty", 8, False) in fake.calls
    assert "pageable" in caplog.text
    assert np.array_equal(read(data, digest)["w"].array, weights.array)


def test_a_cpu_tensor_is_copied_at_capture_so_the_trainer_may_step_at_once(
    torch: FakeTorch,
) -> None:
    weights = torch.tensor([1.0, 2.0, 3.0])
    captured = staging.Stager().capture("job", 0, 1, {"w": weights})
    weights.array += 10  # optimizer.step() before the shard is written
    dest = np.empty(captured.layout.size, dtype=np.uint8)
    digest = staging.write_shard(captured, dest)
    assert read(dest.tobytes(), digest)["w"].array.tolist() == [1.0, 2.0, 3.0]


def test_buffers_of_values_no_longer_saved_are_given_up(torch: FakeTorch) -> None:
    stager = staging.Stager()
    stager.capture("job", 0, 1, {"a": torch.tensor([1.0]), "b": torch.tensor([2.0])})
    stager.capture("job", 0, 2, {"a": torch.tensor([1.0])})
    stager.capture("job", 0, 3, {"a": torch.tensor([1.0]), "b": torch.tensor([2.0])})
    assert [c for c in torch.calls if c[0] == "empty"] == [("empty", 4, False)] * 3


def test_a_restore_fills_device_tensors_on_their_device(torch: FakeTorch) -> None:
    weights = torch.tensor(np.arange(32), NPU)
    data, digest = stage(npu_stager(torch), {"w": weights})
    mine = torch.tensor(np.zeros(32), NPU)
    restored = read(data, digest, into={"w": mine})["w"]
    assert restored is mine
    assert ("copy_", "cpu", "npu", False) in torch.calls
    assert np.array_equal(mine.array, weights.array)


def test_a_device_tensor_of_another_size_gets_a_new_tensor_on_its_device(
    torch: FakeTorch,
) -> None:
    weights = torch.tensor(np.arange(32), NPU)
    data, digest = stage(npu_stager(torch), {"w": weights})
    mine = torch.tensor(np.zeros(8), NPU)
    restored = read(data, digest, into={"w": mine})["w"]
    assert restored is not mine
    assert restored.device == NPU
    assert np.array_equal(restored.array, weights.array)


@pytest.mark.parametrize(
    ("lookup", "expected"),
    [
        pytest.param({"get_device_module": lambda d: f"module of {d.type}"}, "module of npu",
                     id="torch.get_device_module when torch has it"),
        pytest.param({"npu": "torch.npu"}, "torch.npu", id="else the torch attribute of its type"),
        pytest.param({}, None, id="else none"),
    ],
)  # fmt: skip
def test_the_device_module_is_what_torch_names(
    monkeypatch: pytest.MonkeyPatch, lookup: dict[str, Any], expected: Any
) -> None:
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(**lookup))
    assert staging.device_module(NPU) == expected


@pytest.mark.parametrize(
    ("module", "expected"),
    [
        pytest.param(DeviceModule(), True, id="a module with streams and events"),
        pytest.param(SimpleNamespace(Stream=object), False, id="a module without events"),
        pytest.param(None, False, id="no module"),
    ],
)
def test_only_modules_with_streams_and_events_copy_on_a_side_stream(
    module: Any, expected: bool
) -> None:
    assert staging.has_streams(module) is expected
