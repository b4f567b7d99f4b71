"""What capture costs the server's forwards, by cause, so that a cost is never silent.

Two kinds: the time the hook itself holds a forward (building the step's index line, staging
the device-to-host copies, waiting for the in-flight budget or a free host buffer, handing
the step to the writer), and the time any thread of the server's process waits to run
(Python's interpreter lock, or a core), which writer threads inside the scheduler's process
add to every step the scheduler takes. The second is measured by `LockProbe`: a thread that
sleeps a few milliseconds at a time and records how late it wakes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Deque, Dict

CAUSES = ("step_line", "staging", "budget_wait", "buffer_wait", "handoff")
LABELS = {"step_line": "step line", "staging": "staging copies", "budget_wait": "in-flight budget",
          "buffer_wait": "waiting for a host buffer", "handoff": "hand-off"}


class ForwardCost:
    def __init__(self) -> None:
        self.seconds: Dict[str, float] = dict.fromkeys(CAUSES, 0.0)
        self.steps = 0
        self._lock = threading.Lock()

    def add(self, cause: str, seconds: float) -> None:
        with self._lock:
            self.seconds[cause] += seconds

    def step(self) -> None:
        with self._lock:
            self.steps += 1

    def report(self) -> Dict[str, float]:
        with self._lock:
            out = {f"{c}_s": round(v, 4) for c, v in self.seconds.items()}
            out["held_s"] = round(sum(self.seconds.values()), 4)
            out["steps"] = self.steps
        return out

    @staticmethod
    def describe(report: Dict[str, float]) -> str:
        parts = ", ".join(f"{LABELS[c]} {report[c + '_s']:.3f} s" for c in CAUSES)
        return f"forwards held {report['held_s']:.3f} s by capture over {report['steps']} steps ({parts})"


class LockProbe:
    """Wakes every `period_s` and records how much later than asked it ran."""

    def __init__(self, period_s: float = 0.005, keep: int = 20000) -> None:
        self.period_s = period_s
        self._late: Deque[float] = deque(maxlen=keep)
        self._total = 0.0
        self._count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hscap-lock-probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(self.period_s)
            late = max(0.0, time.perf_counter() - t0 - self.period_s)
            self._late.append(late)
            self._total += late
            self._count += 1

    def report(self) -> Dict[str, float]:
        late = sorted(self._late)
        if not late:
            return {"wake_delay_mean_ms": 0.0, "wake_delay_p99_ms": 0.0, "wake_delay_max_ms": 0.0}
        return {"wake_delay_mean_ms": round(1e3 * self._total / max(1, self._count), 3),
                "wake_delay_p99_ms": round(1e3 * late[min(len(late) - 1, int(0.99 * len(late)))], 3),
                "wake_delay_max_ms": round(1e3 * late[-1], 3)}

    @staticmethod
    def describe(report: Dict[str, float]) -> str:
        return (f"a thread of this process woke {report['wake_delay_mean_ms']:.2f} ms late on average "
                f"(p99 {report['wake_delay_p99_ms']:.2f} ms) from a {LockProbe().period_s * 1e3:.0f} ms sleep")
