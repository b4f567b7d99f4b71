"""How far behind the shard writer is, and what that costs the forward.

Three numbers decide it: the bytes in flight (staged, not yet indexed) against the budget,
past which a forward waits (or its step is dropped); the bytes queued that no writer thread
has picked up yet, which decide when a step is written raw to catch up; and the bytes
produced per second, for the one loud report when even raw writes cannot keep up.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, Optional

# Forwards held this long in total: the writer is behind even with raw writes.
DISK_BOUND_AFTER_S = 1.0


class Budget:
    """Bytes in flight between stage() and the index line. One oversize step may pass alone."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.waited_s = 0.0  # time forwards spent held by back-pressure
        self._cond = threading.Condition()

    def acquire(self, n: int, block: bool) -> bool:
        with self._cond:
            if self.used and self.used + n > self.limit:
                if not block:
                    return False
                t0 = time.monotonic()
                while self.used and self.used + n > self.limit:
                    self._cond.wait()
                self.waited_s += time.monotonic() - t0
            self.used += n
            self.peak = max(self.peak, self.used)
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()


class Backlog:
    """The budget, the queue of steps waiting for a thread, and the produced rate."""

    def __init__(self, limit: int) -> None:
        self.budget = Budget(limit)
        self.produced = 0
        self._t0: Optional[float] = None
        self._waiting = 0
        self._lock = threading.Lock()

    def admit(self, nbytes: int, block: bool) -> bool:
        """A step produced: counted, then let in under the budget (False: full, not blocking)."""
        if self._t0 is None:
            self._t0 = time.monotonic()
        self.produced += nbytes
        return self.budget.acquire(nbytes, block)

    def queued(self, nbytes: int) -> None:
        with self._lock:
            self._waiting += nbytes

    def picked(self, nbytes: int) -> bool:
        """A thread took a queued step. True when the writer is behind: the steps still waiting
        hold over a quarter of the budget, so they would fill it before a thread that compresses
        this one came back (write it raw)."""
        with self._lock:
            self._waiting -= nbytes
            return self._waiting * 4 > self.budget.limit

    def done(self, nbytes: int) -> None:
        self.budget.release(nbytes)

    @staticmethod
    def held_too_long(waited_s: float) -> bool:
        """waited_s: every wait of the forwards (the budget's and the pinned buffers')."""
        return waited_s > DISK_BOUND_AFTER_S

    def gbps(self, nbytes: int) -> float:
        """nbytes over the time since the first step, in GB/s."""
        return nbytes / 1e9 / max(1e-9, time.monotonic() - (self._t0 or time.monotonic()))

    def rates(self, written_raw: int, to_disk: int, waited_s: float) -> Dict[str, float]:
        """What the disk-bound report says: forwards held, produced, written and on-disk rates."""
        return {"time": time.time(), "forward_waited_s": round(waited_s, 3),
                "produced_gbps": round(self.gbps(self.produced), 4), "written_gbps": round(self.gbps(written_raw), 4),
                "to_disk_gbps": round(self.gbps(to_disk), 4)}
