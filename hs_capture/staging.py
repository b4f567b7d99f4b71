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
    """Reusable pinned host buffers, by power-of-two size class (cudaHostAlloc is slow)."""

    def __init__(self) -> None:
        self._free: Dict[int, List[torch.Tensor]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _size_class(nbytes: int) -> int:
        return max(1 << 20, 1 << max(0, nbytes - 1).bit_length())

    def take(self, nbytes: int) -> torch.Tensor:
        size = self._size_class(nbytes)
        with self._lock:
            bucket = self._free.get(size)
            if bucket:
                return bucket.pop()
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(buf.numel(), []).append(buf)

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
    def __init__(self) -> None:
        self._pool = PinnedPool()
        self._stream = None

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
        return Staged(out, nbytes, event, buffers)

    def release(self, staged: Staged) -> None:
        for buf in staged.buffers:
            self._pool.give(buf)
        staged.buffers = []
