"""How far behind the shard writer is, and what that costs the forward.

Two numbers decide it: the bytes in flight (staged, not yet indexed) against the budget,
past which a forward waits (or its step is dropped); and the bytes produced per second, for
the one loud report when even raw writes cannot keep up. (When a step is written raw to catch
up is the writing side's call: store.StoreWorkers.)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, Optional, Tuple

# Forwards held this long in total: the writer is behind even with raw writes.
DISK_BOUND_AFTER_S = 1.0
# The report's rates are over the steps of this last stretch, not since the first step: a
# server idle between sends would otherwise report a fraction of what its disk writes.
RATE_WINDOW_S = 10.0


def wait_or_serve(cond: threading.Condition, serve: Optional[Callable[[], None]]) -> None:
    """Wait on `cond` (held) for a notify; or, where a waiting forward must itself hear the
    writer (writer_process's hand-off "forward"), release it and run `serve` once."""
    if serve is None:
        cond.wait()
        return
    cond.release()
    try:
        serve()
    finally:
        cond.acquire()


class Budget:
    """Bytes in flight between stage() and the index line. One oversize step may pass alone."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.waited_s = 0.0  # time forwards spent held by back-pressure
        self._cond = threading.Condition()
        self._aborted = False
        self.wait_with: Optional[Callable[[], None]] = None  # as staging.PinnedPool's

    def acquire(self, n: int, block: bool) -> bool:
        """False: full and not blocking, or aborted (the writer is gone)."""
        with self._cond:
            if self.used and self.used + n > self.limit:
                if not block:
                    return False
                t0 = time.monotonic()
                while self.used and self.used + n > self.limit and not self._aborted:
                    wait_or_serve(self._cond, self.wait_with)
                self.waited_s += time.monotonic() - t0
            if self._aborted:
                return False
            self.used += n
            self.peak = max(self.peak, self.used)
            return True

    def release(self, n: int) -> None:
        with self._cond:
            self.used -= n
            self._cond.notify_all()

    def abort(self) -> None:
        with self._cond:
            self._aborted = True
            self._cond.notify_all()


class Backlog:
    """The budget and the produced rate."""

    def __init__(self, limit: int) -> None:
        self.budget = Budget(limit)
        self.produced = 0
        self._t0: Optional[float] = None
        self._lock = threading.Lock()
        # (time, produced, written raw, to disk) at each step, the last RATE_WINDOW_S of them
        self._history: Deque[Tuple[float, int, int, int]] = deque()
        self._before: Optional[Tuple[float, int, int, int]] = None  # the last one dropped from it

    def admit(self, nbytes: int, block: bool) -> bool:
        """A step produced: counted, then let in under the budget (False: full, not blocking)."""
        if self._t0 is None:
            self._t0 = time.monotonic()
        self.produced += nbytes
        return self.budget.acquire(nbytes, block)

    def done(self, nbytes: int) -> None:
        self.budget.release(nbytes)

    @staticmethod
    def held_too_long(waited_s: float) -> bool:
        """waited_s: every wait of the forwards (the budget's and the pinned buffers')."""
        return waited_s > DISK_BOUND_AFTER_S

    def sample(self, written_raw: int, to_disk: int) -> None:
        """The counters as a step is submitted (the rates' history); keeps the last window."""
        now = time.monotonic()
        with self._lock:
            self._history.append((now, self.produced, written_raw, to_disk))
            while len(self._history) > 1 and self._history[0][0] < now - RATE_WINDOW_S:
                self._before = self._history.popleft()

    def rates(self, written_raw: int, to_disk: int, waited_s: float) -> Dict[str, float]:
        """What the disk-bound report says: forwards held, and the produced, written and on-disk
        rates over the last window of steps (with one step in it: since the step before)."""
        now = time.monotonic()
        with self._lock:
            base = (self._history[0] if len(self._history) > 1 else self._before or (self._t0 or now, 0, 0, 0))
        elapsed = max(1e-9, now - base[0])

        def gbps(cur: int, then: int) -> float:
            return round((cur - then) / 1e9 / elapsed, 4)

        return {"time": time.time(), "forward_waited_s": round(waited_s, 3), "window_s": round(elapsed, 1),
                "produced_gbps": gbps(self.produced, base[1]), "written_gbps": gbps(written_raw, base[2]),
                "to_disk_gbps": gbps(to_disk, base[3])}
