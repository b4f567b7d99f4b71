"""What the hook costs the server's forwards, by cause, so that a cost is never silent: the
time it holds a forward building the step's index line, quantizing the states (the compact
tier: enqueuing it on the device), staging the device-to-host copies,
waiting for the in-flight budget or a free host buffer, and handing the step to the writer."""

from __future__ import annotations

import threading
from typing import Dict

CAUSES = ("step_line", "quantize", "staging", "budget_wait", "buffer_wait", "handoff")
LABELS = {"step_line": "step line", "quantize": "quantizing", "staging": "staging copies", "budget_wait": "in-flight budget",
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
