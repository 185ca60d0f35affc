"""Moving a trainer's state into shard bytes and back, at memory speed.

Called by the trainer client (``client.Checkpointer``) and by the GPU benchmark.

* ``Stager.capture`` takes a state (a mapping of names to bytes, NumPy arrays or PyTorch
  tensors) so that the trainer may go on at once (``Checkpointer.save`` returns before the
  bytes are copied):
  - NumPy arrays are not copied: they are made read-only until their bytes are copied, so a
    trainer that writes too early gets an error instead of a torn checkpoint;
  - CPU tensors cannot be made read-only (an optimizer step writes them in place), so they
    are copied at once into host buffers allocated once per value and reused by every save,
    unless the caller lends them (``borrow``: a state that is already a staged copy, which
    nobody writes until the capture is written);
  - tensors on an accelerator (CUDA, Ascend NPU through torch_npu, any device whose torch
    module has streams: ``device_module``) are copied on a side stream of their device into
    pinned host buffers, reused likewise (never a pageable copy); ``Captured.ready`` waits
    for the copies. A device whose module has no streams is copied with ``tensor.to("cpu")``.
* ``write_shard`` copies the captured values into a destination buffer (a daemon's shared
  memory or an upload buffer) in cache-sized pieces, hashing each piece while it is hot.
* ``read_shard`` fills a state from a stream of shard bytes, hashing as it reads, into the
  caller's arrays and tensors when given (``into``: a tensor on a device is filled there once
  its bytes are verified) or into one fresh buffer the arrays are views of.
* ``read_entry`` reads one entry's bytes from the start of a shard and no further: unverified
  (the shard's checksum covers all of it), for an entry that carries a checksum of its own.

torch is optional: it is never imported to save (a tensor can only come from a trainer that
imported it) and imported to restore only when a shard holds tensors.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from matrixpool_recovery import checksum, errors, shard

log = logging.getLogger(__name__)
PIECE = 256 << 10  # copy and hash in pieces that stay in the L2 cache
READ_PIECE = 4 << 20  # network and file reads: large, then hashed
Bytes = npt.NDArray[np.uint8]
ReadInto = Callable[[memoryview], int]  # fills a buffer, returns bytes read (0 at end)


def _torch() -> Any:
    return sys.modules.get("torch")


def is_tensor(value: object) -> bool:
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor)


def device_module(device: Any) -> Any:
    """The torch module of a device (``torch.cuda``; ``torch.npu`` once torch_npu is
    imported), or None when torch has none for its type."""
    torch = _torch()
    lookup = getattr(torch, "get_device_module", None)  # torch >= 2.3
    if lookup is not None:
        try:
            return lookup(device)
        except (RuntimeError, ValueError, AttributeError):
            return None
    return getattr(torch, device.type, None)


def has_streams(module: Any) -> bool:
    """Whether a device module can copy on a side stream and signal the end with an event."""
    needed = ("Stream", "Event", "stream", "current_stream")
    return module is not None and all(hasattr(module, name) for name in needed)


@dataclass
class Captured:
    """A state held for staging: its layout and a host view of each value."""

    layout: shard.Layout
    views: list[Bytes]  # host bytes of each entry, valid once ready() returned
    guarded: list[npt.NDArray[Any]] = field(default_factory=list)  # made read-only by capture
    events: list[Any] = field(default_factory=list)  # device events ending the copies

    def ready(self) -> None:
        """Block until device-to-host copies into the pinned buffers are done."""
        for event in self.events:
            event.synchronize()
        self.events.clear()

    def release(self) -> None:
        """Give the caller its arrays back (writable again)."""
        for array in self.guarded:
            array.flags.writeable = True
        self.guarded.clear()


class Stager:
    """Captures states; owns the reused host buffers and the devices' side streams.

    A buffer is reused by the next capture of the same value: the caller captures again only
    once the previous capture was written (``Checkpointer.save`` waits for it to be staged).
    """

    def __init__(self, modules: Callable[[Any], Any] = device_module) -> None:
        self._modules = modules  # device -> its torch module (injected by tests)
        self._buffers: dict[tuple[str, int, bool], Any] = {}  # (name, bytes, pinned) -> uint8
        self._streams: dict[Any, Any] = {}  # device -> side stream

    def capture(
        self, job: str, rank: int, step: int, state: Mapping[str, Any], *, borrow: bool = False
    ) -> Captured:
        """Hold `state` for writing. `borrow`: CPU tensors are viewed, not copied (the caller
        leaves them alone until the capture is written)."""
        described: list[tuple[str, str, str, tuple[int, ...], int]] = []
        captured = Captured(shard.plan(job, rank, step, []), [])
        used: dict[tuple[str, int, bool], Any] = {}
        for name, value in state.items():
            if not isinstance(name, str):
                raise TypeError(f"state keys must be str, not {type(name).__name__}")
            kind, dtype, shape, view = self._host_view(name, value, captured, used, borrow)
            described.append((name, kind, dtype, shape, view.nbytes))
            captured.views.append(view)
        self._buffers = used  # values no longer saved give their buffers up
        captured.layout = shard.plan(job, rank, step, described)
        return captured

    def _host_view(
        self,
        name: str,
        value: Any,
        captured: Captured,
        used: dict[tuple[str, int, bool], Any],
        borrow: bool,
    ) -> tuple[str, str, tuple[int, ...], Bytes]:
        if isinstance(value, bytes | bytearray | memoryview):
            data = bytes(value) if not isinstance(value, bytes) else value
            return "bytes", "", (), np.frombuffer(data, dtype=np.uint8)
        if isinstance(value, np.generic):  # a NumPy scalar comes back as a 0-d array
            value = np.asarray(value)
        if isinstance(value, np.ndarray):
            return "numpy", value.dtype.str, value.shape, _guard(value, captured)
        if is_tensor(value):
            view = self._tensor(name, value, captured, used, borrow)
            return "torch", str(value.dtype), tuple(value.shape), view
        raise TypeError(f"state[{name!r}]: bytes, NumPy arrays or torch tensors, not {type(value)}")

    def _tensor(
        self,
        name: str,
        tensor: Any,
        captured: Captured,
        used: dict[tuple[str, int, bool], Any],
        borrow: bool,
    ) -> Bytes:
        flat = tensor.detach().contiguous().reshape(-1).view(_torch().uint8)
        if flat.device.type == "cpu" and borrow:
            return np.asarray(flat.numpy())  # the array keeps the tensor (or its copy) alive
        if flat.device.type == "cpu":
            host = self._buffer(name, flat.numel(), False, used)
            host.copy_(flat)  # the trainer may write the tensor as soon as save() returns
            return np.asarray(host.numpy())
        module = self._modules(flat.device)
        if not has_streams(module):
            return np.asarray(flat.to("cpu").numpy())
        host = self._buffer(name, flat.numel(), True, used)
        captured.events.append(self._copy_on_side_stream(module, flat, host))
        return np.asarray(host.numpy())

    def _buffer(
        self, name: str, nbytes: int, pinned: bool, used: dict[tuple[str, int, bool], Any]
    ) -> Any:
        key = (name, nbytes, pinned)
        found = self._buffers.get(key)
        used[key] = found if found is not None else _host_buffer(nbytes, pinned)
        return used[key]

    def _copy_on_side_stream(self, module: Any, flat: Any, host: Any) -> Any:
        """Queue the copy after the work the trainer queued so far; the event marks its end."""
        device = flat.device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = module.Stream(device)
        stream.wait_stream(module.current_stream(device))
        with module.stream(stream):
            host.copy_(flat, non_blocking=True)
            event = module.Event()
            event.record(stream)
        flat.record_stream(stream)  # the allocator keeps its memory until the copy is done
        return event


def _host_buffer(nbytes: int, pinned: bool) -> Any:
    """A uint8 host tensor; pinned by torch's accelerator allocator (CUDA, NPU) if asked."""
    torch = _torch()
    if pinned:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as err:  # no allocator pins: a pageable buffer is still correct
            log.warning("pinned host memory unavailable, staging through pageable: %s", err)
    return torch.empty(nbytes, dtype=torch.uint8)


def _guard(array: npt.NDArray[Any], captured: Captured) -> Bytes:
    if array.dtype.hasobject:
        raise TypeError("NumPy arrays of Python objects cannot be checkpointed")
    contiguous = np.ascontiguousarray(array)
    if (contiguous is array or contiguous.base is array) and array.flags.writeable:
        array.flags.writeable = False
        captured.guarded.append(array)
    return contiguous.reshape(-1).view(np.uint8)


def write_shard(captured: Captured, dest: Bytes, algorithm: str = checksum.DEFAULT) -> str:
    """Copy a captured state into dest (exactly layout.size bytes); return its checksum."""
    layout = captured.layout
    if dest.nbytes != layout.size:
        raise ValueError(f"destination of {dest.nbytes} bytes for a {layout.size}-byte shard")
    running = checksum.Running(algorithm)
    head = np.frombuffer(layout.head, dtype=np.uint8)
    _copy_hashing(head, dest[: head.nbytes], running)
    position = layout.payload_start
    captured.ready()
    for entry, view in zip(layout.entries, captured.views, strict=True):
        start = layout.payload_start + entry.offset
        dest[position:start] = 0
        running.update(dest[position:start].data)
        _copy_hashing(view, dest[start : start + entry.nbytes], running)
        position = start + entry.nbytes
    return running.value


def _copy_hashing(source: Bytes, dest: Bytes, running: checksum.Running) -> None:
    for offset in range(0, source.nbytes, PIECE):
        piece = dest[offset : offset + PIECE]
        np.copyto(piece, source[offset : offset + PIECE])
        running.update(piece.data)


def read_shard(
    read_into: ReadInto, size: int, expected: str, into: Mapping[str, Any] | None = None
) -> tuple[shard.Layout, dict[str, Any]]:
    """Read a whole shard of `size` bytes, verify it against `expected`, return its state."""
    running = checksum.Running(checksum.algorithm_of(expected))
    prefix = _read_exactly(read_into, shard.PREFIX, running)
    header = _read_exactly(read_into, shard.header_length(prefix), running)
    layout = shard.parse(prefix, header)
    if layout.size != size:
        raise errors.IntegrityError(f"shard is {size} bytes, its header says {layout.size}")
    position = _skip(read_into, shard.PREFIX + len(header), layout.payload_start, running)
    targets, state = _targets(layout, into)
    for entry, target in zip(layout.entries, targets, strict=True):
        start = layout.payload_start + entry.offset
        position = _skip(read_into, position, start, running)
        _fill(read_into, target, running)
        position = start + entry.nbytes
    if read_into(memoryview(bytearray(1))) != 0:
        raise errors.IntegrityError(f"shard longer than its {size} bytes")
    checksum.verify(expected, running, f"shard {layout.job}/{layout.rank}/{layout.step}")
    _finish_torch(layout, targets, state, into)
    return layout, state


def read_entry(read_into: ReadInto, name: str) -> bytes:
    """The bytes of entry `name`, read from the start of a shard up to its end (unverified)."""
    running = checksum.Running()  # unused: the shard's checksum needs every byte
    prefix = _read_exactly(read_into, shard.PREFIX, running)
    header = _read_exactly(read_into, shard.header_length(prefix), running)
    layout = shard.parse(prefix, header)
    entry = next((e for e in layout.entries if e.name == name), None)
    if entry is None:
        raise errors.IntegrityError(f"shard {layout.job}/{layout.rank}/{layout.step} has no {name}")
    start = layout.payload_start + entry.offset
    _skip(read_into, shard.PREFIX + len(header), start, running)
    return _read_exactly(read_into, entry.nbytes, running)


def _read_exactly(read_into: ReadInto, count: int, running: checksum.Running) -> bytes:
    buffer = bytearray(count)
    _fill(read_into, np.frombuffer(buffer, dtype=np.uint8), running)
    return bytes(buffer)


def _skip(read_into: ReadInto, position: int, until: int, running: checksum.Running) -> int:
    if until < position:
        raise errors.IntegrityError("overlapping entries in shard header")
    _fill(read_into, np.zeros(until - position, dtype=np.uint8), running)
    return until


def _fill(read_into: ReadInto, target: Bytes, running: checksum.Running) -> None:
    view = target.data.cast("B")
    offset = 0
    for _ in range(target.nbytes // 4096 + 64):  # bounded: each read returns >0 or ends
        if offset == len(view):
            return
        got = read_into(view[offset : offset + READ_PIECE])
        if got <= 0:
            raise errors.IntegrityError(f"shard ended early ({offset} of {len(view)} bytes)")
        running.update(view[offset : offset + got])
        offset += got
    if offset != len(view):
        raise errors.IntegrityError("shard stream returned too many short reads")


def _targets(
    layout: shard.Layout, into: Mapping[str, Any] | None
) -> tuple[list[Bytes], dict[str, Any]]:
    """Where each entry's bytes go, and the state those bytes become."""
    payload = layout.size - layout.payload_start
    spare = None if into is not None and _all_in(layout, into) else np.empty(payload, np.uint8)
    targets: list[Bytes] = []
    state: dict[str, Any] = {}
    for entry in layout.entries:
        if spare is None or (into is not None and _fits(entry, into.get(entry.name))):
            assert into is not None
            target, value = _caller_target(entry, into[entry.name])
        else:
            target = spare[entry.offset : entry.offset + entry.nbytes]
            value = _value(entry, target)
        targets.append(target)
        state[entry.name] = value
    return targets, state


def _all_in(layout: shard.Layout, into: Mapping[str, Any]) -> bool:
    return all(_fits(e, into.get(e.name)) for e in layout.entries)


def _fits(entry: shard.Entry, value: Any) -> bool:
    if isinstance(value, np.ndarray):
        return (
            entry.kind == "numpy"
            and value.nbytes == entry.nbytes
            and value.flags.c_contiguous
            and value.flags.writeable
        )
    return (
        entry.kind == "torch"
        and is_tensor(value)
        and value.is_contiguous()
        and (value.numel() * value.element_size() == entry.nbytes)
    )


def _caller_target(entry: shard.Entry, value: Any) -> tuple[Bytes, Any]:
    if isinstance(value, np.ndarray):
        return value.reshape(-1).view(np.uint8), value
    if value.device.type != "cpu":  # read into host memory, copied to the device once verified
        return np.empty(entry.nbytes, dtype=np.uint8), value
    return np.asarray(value.detach().reshape(-1).view(_torch().uint8).numpy()), value


def _value(entry: shard.Entry, target: Bytes) -> Any:
    if entry.kind == "bytes":
        return target  # turned into bytes once verified
    if entry.kind == "numpy":
        return target.view(np.dtype(entry.dtype)).reshape(entry.shape)
    return target  # turned into a tensor once verified


def _finish_torch(
    layout: shard.Layout,
    targets: list[Bytes],
    state: dict[str, Any],
    into: Mapping[str, Any] | None,
) -> None:
    """Turn verified bytes into bytes objects and tensors (torch imported only if needed)."""
    for entry, target in zip(layout.entries, targets, strict=True):
        if entry.kind == "bytes":
            state[entry.name] = target.tobytes()
        elif entry.kind == "torch":
            caller = None if into is None else into.get(entry.name)
            filled = caller is not None and state[entry.name] is caller
            state[entry.name] = _tensor_from(entry, target, caller, filled)


def _tensor_from(entry: shard.Entry, target: Bytes, caller: Any, filled: bool) -> Any:
    """The tensor of an entry: the caller's own when it took the bytes (on its device), else
    a new one, on the caller's device when the caller gave a tensor of another size."""
    try:
        import torch  # type: ignore[import-not-found, unused-ignore]
    except ImportError as err:
        raise errors.CheckpointError(
            f"shard entry {entry.name!r} is a tensor; install torch"
        ) from err
    if filled and caller.device.type != "cpu":
        caller.detach().reshape(-1).view(torch.uint8).copy_(torch.from_numpy(target))
    if filled:
        return caller
    dtype = getattr(torch, entry.dtype.removeprefix("torch."))
    if entry.nbytes:
        host = torch.from_numpy(target).view(dtype).reshape(entry.shape)
    else:  # no bytes: an empty array's stride is 0, which view() refuses
        host = torch.empty(entry.shape, dtype=dtype)
    if is_tensor(caller) and caller.device.type != "cpu":
        return host.to(caller.device)
    return host
