"""Getting captured tensors off the device without stalling it.

CUDA tensors are copied asynchronously into pinned host buffers on a side stream
(`.cpu()` blocks the step and copies through pageable memory; the rates:
benchmarks/README.md, gpu/capture.py); the writer thread waits on the copy's event. CPU tensors are cloned: SGLang reuses
its buffers once forward returns.

The side-stream copy runs LATER than the forward's own stream moves on. Under SGLang's
overlap scheduler the next batch is loaded as soon as this forward is enqueued, and since
0.5.15 every forward reads its input_ids and positions from fixed buffers that the next
batch's `load_batch` refills on the forward stream (the eager runner's input registry,
shared with the CUDA-graph runners). A side stream that only waited for this forward races
that refill and copies the next batch's tokens. `record_stream` cannot help: it guards
memory the caching allocator frees, not buffers SGLang keeps and rewrites. So anything that
may live in such a buffer (the batch's inputs, and any view into a larger storage) is first
cloned on the forward's own stream, which orders the clone before any later write there;
the side stream then copies the clone.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Collection, Dict, List, Optional, Protocol

import torch

from hs_capture.dump.hst import dtype_name
from hs_capture.server.backlog import wait_or_serve
from hs_capture.server.step_files import Placed

ALIGN = 256  # each tensor of a step starts on this boundary of its step's buffer


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def step_buffer_bytes(sizes: List[int]) -> int:
    """The bytes of the one buffer that holds a step of tensors of these sizes."""
    return sum(_aligned(n) for n in sizes)


class HostBuffer:
    """One step's host memory: a memfd (so the writer process can map the same pages from the
    fd it is sent), mapped here and, with a GPU, registered with CUDA as pinned memory so the
    device-to-host copy runs asynchronously. Its size is exact (whole pages), so the pinned
    figure the writer reports is what the host really pins."""

    PAGE = mmap.PAGESIZE

    @classmethod
    def size_for(cls, nbytes: int) -> int:
        """What a buffer of nbytes takes: whole pages."""
        return -(-max(nbytes, 1) // cls.PAGE) * cls.PAGE

    def __init__(self, ident: int, nbytes: int, pin: bool) -> None:
        self.ident = ident
        self.nbytes = self.size_for(nbytes)
        self.fd = _memfd(f"hscap-step-{ident}", self.nbytes)
        self._map = mmap.mmap(self.fd, self.nbytes) if self.fd >= 0 else mmap.mmap(-1, self.nbytes)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = False
        if pin:
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
            if int(err) != 0:
                self.free()
                raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes failed (error {int(err)})")
            self.pinned = True

    def free(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = None
        try:
            self._map.close()
        except (BufferError, ValueError):  # a view still exported: the mapping goes with it
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _memfd(name: str, nbytes: int) -> int:
    """An anonymous memory file of nbytes (-1 where the platform has none: in-process only)."""
    if not hasattr(os, "memfd_create"):
        return -1
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


class PinnedPool:
    """Reusable host buffers (HostBuffer), one per step. Pinning host memory is slow (every
    page is locked), so it must never happen in a forward: `prewarm` pins full-size steps on a background thread, buffers
    are recycled best-fit, and once `cap` bytes are pinned a step waits for a buffer the writer
    gives back (back-pressure) instead of pinning more. Only a step larger than every buffer
    made is pinned anew: buffers cut short of the real step therefore serialize every full step
    on the few big enough (benchmarks/README.md, gpu/pinned_pool.py). `on_new` hears of each new
    buffer before any step uses it (the writer process maps it)."""

    def __init__(self, pin: bool = True, cap: int = 0, on_new: Optional[Callable[[HostBuffer], None]] = None) -> None:
        self._pin = pin  # False without CUDA: the buffers are shared, not pinned
        self._cap = cap  # 0: no cap
        self.on_new = on_new
        self._free: List[HostBuffer] = []  # sorted by size
        self._next_id = 0
        self._cond = threading.Condition()
        self._largest = 0
        self._aborted = False
        self.pinned_bytes = 0
        self.buffers = 0  # made so far; those not in `_free` are in flight
        self.hot_allocs = 0  # allocations a forward had to wait for
        self.waited_s = 0.0  # time forwards waited for a buffer to come back
        # what a waiting forward does instead of sleeping (the writer's replies, read by the
        # forward itself, give the buffers back: writer_process's hand-off "forward")
        self.wait_with: Optional[Callable[[], None]] = None

    rounded = staticmethod(HostBuffer.size_for)  # what a buffer of nbytes actually takes

    def _alloc(self, nbytes: int) -> HostBuffer:
        with self._cond:
            ident, self._next_id = self._next_id, self._next_id + 1
        buf = HostBuffer(ident, nbytes, self._pin)
        if self.on_new is not None:
            self.on_new(buf)
        with self._cond:
            self.pinned_bytes += buf.nbytes
            self.buffers += 1
            self._largest = max(self._largest, buf.nbytes)
        return buf

    def in_flight(self) -> int:
        """Buffers taken and not yet given back (their steps are not on disk yet)."""
        with self._cond:
            return self.buffers - len(self._free)

    def take(self, nbytes: int, block: bool = True) -> Optional[HostBuffer]:
        """A buffer of at least nbytes; None when `block` is False and the pool is at its cap,
        or when the pool was aborted (the writer is gone)."""
        with self._cond:
            while True:
                if self._aborted:
                    return None
                for i, buf in enumerate(self._free):
                    if buf.nbytes >= nbytes:
                        return self._free.pop(i)
                if (not self._cap or self.pinned_bytes + self.rounded(nbytes) <= self._cap
                        or self.rounded(nbytes) > self._largest):
                    self.hot_allocs += 1
                    break
                if not block:
                    return None
                t0 = time.monotonic()
                wait_or_serve(self._cond, self.wait_with)
                self.waited_s += time.monotonic() - t0
        return self._alloc(nbytes)

    def give(self, buf: HostBuffer) -> None:
        with self._cond:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.nbytes)
            self._cond.notify_all()

    def abort(self) -> None:
        """Wake every waiting forward with nothing: the writer is gone."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()

    def prewarm(self, sizes: List[int]) -> None:
        for n in sizes:
            self.give(self._alloc(n))

    def trim(self) -> None:
        """Free the buffers not in flight (at close)."""
        with self._cond:
            free, self._free = self._free, []
        for buf in free:
            buf.free()


@dataclass
class Staged:
    """One step's tensors in one host buffer; `ready()` blocks until they are valid.
    `layout` places each tensor in the buffer (what the writer process needs to read it)."""

    tensors: Dict[str, torch.Tensor]
    nbytes: int
    event: Optional[object] = None
    buffer: Optional[HostBuffer] = None
    layout: List[Placed] = field(default_factory=list)

    def ready(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class AsyncCopier(Protocol):
    """How device tensors reach host buffers after the forward. `own` runs on the producing
    (forward) stream, in its order; `copy` is enqueued to run later; `finish` returns what
    `Staged.ready()` waits on."""

    pin_memory: bool

    def own(self, t: torch.Tensor) -> torch.Tensor: ...

    def begin(self) -> None: ...

    def copy(self, host: torch.Tensor, t: torch.Tensor) -> None: ...

    def finish(self) -> object: ...


class CudaSideStream:
    """The copy on one side stream that waits for the forward's stream at submit."""

    pin_memory = True

    def __init__(self) -> None:
        self._stream = torch.cuda.Stream()

    def own(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()  # on the current (forward) stream: ordered before the next batch's refill

    def begin(self) -> None:
        self._stream.wait_stream(torch.cuda.current_stream())  # the copy must see the finished forward

    def copy(self, host: torch.Tensor, t: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream):
            if not t.is_contiguous():
                t = t.contiguous()  # rare (a strided view): one device copy, on the side stream
            host.copy_(t, non_blocking=True)
            # Keep the caching allocator from handing this memory to the next step before
            # our copy has read it (tensors the forward allocated, and our own clones).
            t.record_stream(self._stream)

    def finish(self) -> object:
        # blocking: the thread that waits for it sleeps in the driver; a default event's wait
        # spins a core inside the driver, against the launches of the scheduler's own thread
        event = torch.cuda.Event(blocking=True)
        event.record(self._stream)
        return event


class CpuCopy:
    """CPU tensors: copied at once, in the forward (nothing can change under a copy taken now)."""

    pin_memory = False

    def own(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def begin(self) -> None:
        pass

    def copy(self, host: torch.Tensor, t: torch.Tensor) -> None:
        host.copy_(t)

    def finish(self) -> object:
        return None


def may_be_refilled(t: torch.Tensor) -> bool:
    """A view into a larger storage: possibly a buffer SGLang keeps and refills for the next
    batch (input registries, CUDA-graph outputs), not memory this forward allocated for itself."""
    return t.untyped_storage().nbytes() > t.numel() * t.element_size()


class Stager:
    def __init__(self, expected_rows: int = 0, budget_bytes: int = 4 << 30, prewarm_steps: int = 0,
                 copier: Optional[AsyncCopier] = None) -> None:
        """prewarm_steps: full-size steps to pin ahead; 0 = as many as the in-flight budget holds,
        so that in steady state no forward ever pins (past the budget the writer blocks it).
        copier: how device tensors are copied (default: a CUDA side stream for CUDA tensors, made
        on first use, a plain copy for CPU tensors)."""
        self._copier = copier
        pin = copier.pin_memory if copier is not None else torch.cuda.is_available()
        self._pool = PinnedPool(pin=pin, cap=budget_bytes)
        self._expected_rows = expected_rows
        self._budget = budget_bytes
        self._prewarm_steps = prewarm_steps
        self._prewarmed = False

    @property
    def pool(self) -> PinnedPool:
        return self._pool

    def prewarm_async(self, sizes: List[int], device: Optional[int] = None) -> None:
        """Pin full-step buffers (one step = tensors of these sizes) on a background thread, on
        `device`'s context (a bare thread would otherwise create a context, and spend memory,
        on GPU 0)."""
        self._prewarmed = True
        if not sizes:
            return
        step = step_buffer_bytes(sizes)
        steps = self._prewarm_steps or self._budget // max(1, self._pool.rounded(step))
        sizes = [step] * max(1, steps)
        if device is None:
            device = torch.cuda.current_device()

        def work() -> None:
            torch.cuda.set_device(device)
            self._pool.prewarm(sizes)

        threading.Thread(target=work, name="hscap-pin", daemon=True).start()

    def _step_sizes(self, tensors: Dict[str, torch.Tensor]) -> List[int]:
        sizes = []
        for t in tensors.values():
            rows = max(self._expected_rows, t.shape[0]) if t.dim() else 1
            row_bytes = (t.numel() // max(1, t.shape[0]) if t.dim() else 1) * t.element_size()
            sizes.append(rows * row_bytes)
        return sizes

    def _copier_for(self, tensors: Dict[str, torch.Tensor]) -> AsyncCopier:
        if self._copier is not None:
            return self._copier
        if any(t.is_cuda for t in tensors.values()):
            self._copier = CudaSideStream()
            return self._copier
        return _CPU_COPY

    def stage(self, tensors: Dict[str, torch.Tensor], inputs: Collection[str] = (),
              block: bool = True) -> Optional[Staged]:
        """Start copying one step's tensors into one host buffer. `inputs`: names of tensors
        that come from the batch's inputs (always owned first: SGLang refills them for the next
        batch). None when `block` is False and every buffer is in flight, or the pool was aborted."""
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        copier = self._copier_for(tensors)
        buf = self._pool.take(step_buffer_bytes(sizes), block)
        if buf is None:
            return None
        owned = {k: copier.own(t.detach()) if k in inputs or may_be_refilled(t) else t.detach()
                 for k, t in tensors.items()}
        copier.begin()
        out: Dict[str, torch.Tensor] = {}
        layout: List[Placed] = []
        at = 0
        for name, t in owned.items():
            n = t.numel() * t.element_size()
            host = buf.tensor[at: at + n].view(t.dtype).view(t.shape)
            copier.copy(host, t)
            out[name] = host
            layout.append(Placed(name, dtype_name(t.dtype), tuple(int(x) for x in t.shape), at, n))
            at += _aligned(n)
        event = copier.finish()
        if not self._prewarmed and copier.pin_memory:
            self.prewarm_async(self._step_sizes(tensors))
        return Staged(out, sum(sizes), event, buf, layout)

    def release(self, staged: Staged) -> None:
        if staged.buffer is not None:
            self._pool.give(staged.buffer)
            staged.buffer = None


_CPU_COPY = CpuCopy()
