"""Getting captured tensors off the device without stalling it.

CUDA tensors are copied asynchronously into pinned host buffers on a side stream
(`.cpu()` would block the step and run ~47x slower, DESIGN.md section 7); the
writer thread waits on the copy's event. CPU tensors are cloned: SGLang reuses
its buffers once forward returns.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch


class PinnedPool:
    """Reusable pinned host buffers. Pinning runs at ~1 GB/s (measured on the H200: 0.44 s for
    one 8192-token DeepSeek step), so it must never happen per step: buffers are recycled
    best-fit, and `prewarm` pins the expected step sizes on a background thread."""

    GRANULE = 2 << 20

    def __init__(self) -> None:
        self._free: List[torch.Tensor] = []  # sorted by size
        self._lock = threading.Lock()
        self.pinned_bytes = 0
        self.hot_allocs = 0  # allocations a forward had to wait for

    def _alloc(self, nbytes: int) -> torch.Tensor:
        size = -(-max(nbytes, 1) // self.GRANULE) * self.GRANULE
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        with self._lock:
            self.pinned_bytes += size
        return buf

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes:
                    return self._free.pop(i)
            self.hot_allocs += 1
        return self._alloc(nbytes)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.numel())

    def prewarm(self, sizes: List[int]) -> None:
        for n in sizes:
            self.give(self._alloc(n))

    def trim(self) -> None:
        with self._lock:
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


class Stager:
    def __init__(self, expected_rows: int = 0, budget_bytes: int = 4 << 30, prewarm_steps: int = 0) -> None:
        """prewarm_steps: full-size steps to pin ahead; 0 = as many as the in-flight budget holds,
        so that in steady state no forward ever pins (past the budget the writer blocks it)."""
        self._pool = PinnedPool()
        self._stream = None
        self._expected_rows = expected_rows
        self._budget = budget_bytes
        self._prewarm_steps = prewarm_steps
        self._prewarmed = False

    @property
    def pool(self) -> PinnedPool:
        return self._pool

    def prewarm_async(self, sizes: List[int], device: Optional[int] = None) -> None:
        """Pin buffers of these sizes on a background thread, on `device`'s context (a bare
        thread would otherwise create a context, and spend memory, on GPU 0)."""
        self._prewarmed = True
        if not sizes:
            return
        steps = self._prewarm_steps or self._budget // max(1, sum(sizes))
        sizes = sizes * max(1, steps)
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

    def stage(self, tensors: Dict[str, torch.Tensor]) -> Staged:
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if not any(t.is_cuda for t in tensors.values()):
            return Staged({k: t.detach().contiguous().clone() for k, t in tensors.items()}, nbytes)
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        main = torch.cuda.current_stream()
        out: Dict[str, torch.Tensor] = {}
        buffers: List[torch.Tensor] = []
        side = self._stream
        side.wait_stream(main)  # the copy must see the finished forward
        with torch.cuda.stream(side):
            for name, t in tensors.items():
                t = t.detach()
                if not t.is_contiguous():
                    t = t.contiguous()  # rare (a strided view): one device copy, on the side stream
                buf = self._pool.take(t.numel() * t.element_size())
                buffers.append(buf)
                host = buf[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                host.copy_(t, non_blocking=True)
                # Keep the caching allocator from handing this memory to the next
                # step before our copy has read it.
                t.record_stream(side)
                out[name] = host
            event = torch.cuda.Event()
            event.record(side)
        if not self._prewarmed:
            self.prewarm_async(self._step_sizes(tensors))
        return Staged(out, nbytes, event, buffers)

    def release(self, staged: Staged) -> None:
        for buf in staged.buffers:
            self._pool.give(buf)
        staged.buffers = []
