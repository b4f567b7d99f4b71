"""Getting captured tensors off the device without stalling it.

CUDA tensors are copied asynchronously into pinned host buffers on a side stream
(`.cpu()` blocks the step and ran ~47x slower on an H200: 1.1 vs 53 GB/s); the
writer thread waits on the copy's event. CPU tensors are cloned: SGLang reuses
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

import threading
import time
from dataclasses import dataclass, field
from typing import Collection, Dict, List, Optional, Protocol

import torch


ALIGN = 256  # each tensor of a step starts on this boundary of its step's buffer


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def step_buffer_bytes(sizes: List[int]) -> int:
    """The bytes of the one buffer that holds a step of tensors of these sizes."""
    return sum(_aligned(n) for n in sizes)


class PinnedPool:
    """Reusable pinned host buffers, one per step. Pinning runs at ~1 GB/s (measured on the
    H200: 0.44 s for one 8192-token DeepSeek step), so it must never happen in a forward:
    `prewarm` pins full-size steps on a background thread, buffers are recycled best-fit, and
    once `cap` bytes are pinned a step waits for a buffer the writer gives back (back-pressure)
    instead of pinning more. Only a step larger than every buffer made is pinned anew: buffers
    cut short of the real step therefore serialize every full step on the few big enough (prefill
    at 0.30 of the plain server on the H200 when the pre-norm state was left out of the cut).
    Free buffers are not given up for larger ones: torch caches a freed pinned block by its
    power-of-two size and never hands it to a larger request, so the memory would stay pinned."""

    GRANULE = 2 << 20

    def __init__(self, pin: bool = True, cap: int = 0) -> None:
        self._pin = pin  # False only for a CPU copier (tests): pinning needs a CUDA driver
        self._cap = cap  # 0: no cap
        self._free: List[torch.Tensor] = []  # sorted by size
        self._cond = threading.Condition()
        self._largest = 0
        self.pinned_bytes = 0
        self.buffers = 0  # made so far; those not in `_free` are in flight
        self.hot_allocs = 0  # allocations a forward had to wait for
        self.waited_s = 0.0  # time forwards waited for a buffer to come back

    def rounded(self, nbytes: int) -> int:
        """What a buffer of nbytes actually pins."""
        return -(-max(nbytes, 1) // self.GRANULE) * self.GRANULE

    def _alloc(self, nbytes: int) -> torch.Tensor:
        size = self.rounded(nbytes)
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)
        with self._cond:
            self.pinned_bytes += size
            self.buffers += 1
            self._largest = max(self._largest, size)
        return buf

    def in_flight(self) -> int:
        """Buffers taken and not yet given back (their steps are not on disk yet)."""
        with self._cond:
            return self.buffers - len(self._free)

    def take(self, nbytes: int, block: bool = True) -> Optional[torch.Tensor]:
        """A buffer of at least nbytes; None only when `block` is False and the pool is at its cap."""
        with self._cond:
            while True:
                for i, buf in enumerate(self._free):
                    if buf.numel() >= nbytes:
                        return self._free.pop(i)
                if (not self._cap or self.pinned_bytes + self.rounded(nbytes) <= self._cap
                        or self.rounded(nbytes) > self._largest):
                    self.hot_allocs += 1
                    break
                if not block:
                    return None
                t0 = time.monotonic()
                self._cond.wait()
                self.waited_s += time.monotonic() - t0
        return self._alloc(nbytes)

    def give(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.numel())
            self._cond.notify_all()

    def prewarm(self, sizes: List[int]) -> None:
        for n in sizes:
            self.give(self._alloc(n))

    def trim(self) -> None:
        with self._cond:
            self._free.clear()


@dataclass
class Staged:
    """Host copies of one step's tensors; `ready()` blocks until they are valid."""

    tensors: Dict[str, torch.Tensor]
    nbytes: int
    event: Optional[object] = None
    buffers: List[torch.Tensor] = field(default_factory=list)

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
        event = torch.cuda.Event()
        event.record(self._stream)
        return event


def may_be_refilled(t: torch.Tensor) -> bool:
    """A view into a larger storage: possibly a buffer SGLang keeps and refills for the next
    batch (input registries, CUDA-graph outputs), not memory this forward allocated for itself."""
    return t.untyped_storage().nbytes() > t.numel() * t.element_size()


class Stager:
    def __init__(self, expected_rows: int = 0, budget_bytes: int = 4 << 30, prewarm_steps: int = 0,
                 copier: Optional[AsyncCopier] = None) -> None:
        """prewarm_steps: full-size steps to pin ahead; 0 = as many as the in-flight budget holds,
        so that in steady state no forward ever pins (past the budget the writer blocks it).
        copier: how device tensors are copied (default: a CUDA side stream, made on first use)."""
        self._copier = copier
        self._pool = PinnedPool(pin=copier.pin_memory if copier is not None else True, cap=budget_bytes)
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

    def stage(self, tensors: Dict[str, torch.Tensor], inputs: Collection[str] = (),
              block: bool = True) -> Optional[Staged]:
        """Start copying one step's tensors to the host. `inputs`: names of tensors that come
        from the batch's inputs (always owned first: SGLang refills them for the next batch).
        None only when `block` is False and every pinned buffer is in flight."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        copier = self._copier
        if copier is None:
            if not any(t.is_cuda for t in tensors.values()):
                # synchronous: nothing can change under a clone taken now
                return Staged({k: t.detach().contiguous().clone() for k, t in tensors.items()}, nbytes)
            copier = self._copier = CudaSideStream()
        buf = self._pool.take(step_buffer_bytes([t.numel() * t.element_size() for t in tensors.values()]), block)
        if buf is None:
            return None
        owned = {k: copier.own(t.detach()) if k in inputs or may_be_refilled(t) else t.detach()
                 for k, t in tensors.items()}
        copier.begin()
        out: Dict[str, torch.Tensor] = {}
        at = 0
        for name, t in owned.items():
            n = t.numel() * t.element_size()
            host = buf[at: at + n].view(t.dtype).view(t.shape)
            at += _aligned(n)
            copier.copy(host, t)
            out[name] = host
        event = copier.finish()
        if not self._prewarmed and copier.pin_memory:
            self.prewarm_async(self._step_sizes(tensors))
        return Staged(out, nbytes, event, [buf])

    def release(self, staged: Staged) -> None:
        for buf in staged.buffers:
            self._pool.give(buf)
        staged.buffers = []
