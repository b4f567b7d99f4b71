"""What capture costs the server's process, so that a cost is never silent: the time the hook
holds a forward, by cause (building the step's index line, quantizing the states (the compact
tier: enqueuing it on the device), staging the device-to-host copies, waiting for the in-flight
budget or a free host buffer, handing the step to the writer), and the CPU time of capture's own
threads in that process, which hold no forward but compete with the scheduler's thread for cores
and for the interpreter lock (ServerThreads), and the scheduler's own time in capture's request
bookkeeping (SchedulerCost)."""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, Optional, Tuple, TypeVar

T = TypeVar("T")

CAUSES = ("step_line", "quantize", "staging", "budget_wait", "buffer_wait", "handoff")
LABELS = {"step_line": "step line", "quantize": "quantizing", "staging": "staging copies", "budget_wait": "in-flight budget",
          "buffer_wait": "waiting for a host buffer", "handoff": "hand-off"}


class _SecondsByCause:
    """Seconds by cause and a count of what they were spent over (steps, requests)."""
    CAUSES: Tuple[str, ...] = ()
    LABELS: Dict[str, str] = {}
    OVER = ""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = dict.fromkeys(self.CAUSES, 0.0)
        self.count = 0
        self._lock = threading.Lock()

    def add(self, cause: str, seconds: float) -> None:
        with self._lock:
            self.seconds[cause] += seconds

    def report(self) -> Dict[str, float]:
        with self._lock:
            out = {f"{c}_s": round(v, 4) for c, v in self.seconds.items()}
            out["held_s"] = round(sum(self.seconds.values()), 4)
            out[self.OVER] = self.count
        return out

    @classmethod
    def _parts(cls, report: Dict[str, float]) -> str:
        return ", ".join(f"{cls.LABELS[c]} {report[c + '_s']:.3f} s" for c in cls.CAUSES)


class ForwardCost(_SecondsByCause):
    CAUSES, LABELS, OVER = CAUSES, LABELS, "steps"

    def step(self) -> None:
        with self._lock:
            self.count += 1

    @classmethod
    def describe(cls, report: Dict[str, float]) -> str:
        return f"forwards held {report['held_s']:.3f} s by capture over {report['steps']} steps ({cls._parts(report)})"


# the scheduler thread's calls into capture's request bookkeeping (requests.py)
CALLS = ("pick", "cap", "match", "batch")
CALL_LABELS = {"pick": "picking new requests", "cap": "capping prefix matches", "match": "noting matches",
               "batch": "noting prefill batches"}


class SchedulerCost(_SecondsByCause):
    """The time SGLang's scheduler thread spends in capture's request bookkeeping: picking each
    new request (with --follow, judging whether it continues a captured one), capping a
    captured request's prefix match, noting its match and its batch. No forward waits for it,
    but where the scheduler's thread is the server's bottleneck (many short requests, most of
    their prompts from the cache) every request pays it, captured or not."""
    CAUSES, LABELS, OVER = CALLS, CALL_LABELS, "requests"

    def add(self, cause: str, seconds: float) -> None:
        with self._lock:
            self.seconds[cause] += seconds
            self.count += cause == "pick"

    @classmethod
    def describe(cls, report: Dict[str, float]) -> str:
        return (f"the scheduler's thread spent {report['held_s']:.3f} s in capture's request bookkeeping over "
                f"{report['requests']} requests ({cls._parts(report)})")


SCHEDULER = SchedulerCost()  # this process's


# capture's threads in the server's process, by role
ROLES = ("handoff", "replies", "writer")
ROLE_LABELS = {"handoff": "hand-off", "replies": "the writer's replies", "writer": "writer threads"}


class ServerThreads:
    """The CPU seconds of capture's threads in the server's process, by role (`handoff`: waits for
    each step's copy and sends it to the writer process; `replies`: hears the writer process;
    `writer`: the writer threads, when the writing runs in the server's process), and the time
    spent waiting for the steps' device-to-host copies. Each thread reads its own CPU clock after
    each item (time.thread_time: a few hundred ns)."""

    def __init__(self) -> None:
        self._cpu: Dict[int, tuple] = {}  # thread id -> (role, its CPU seconds so far)
        self._copy_wait = 0.0
        self._lock = threading.Lock()

    def tick(self, role: str) -> None:
        ident = threading.get_ident()
        if ident not in self._cpu:
            name_os_thread(threading.current_thread().name)
        self._cpu[ident] = (role, time.thread_time())

    def wait_for_copy(self, ready: Callable[[], T]) -> T:
        t0 = time.perf_counter()
        try:
            return ready()
        finally:
            with self._lock:
                self._copy_wait += time.perf_counter() - t0

    def report(self) -> Dict[str, float]:
        cpu = dict.fromkeys(ROLES, 0.0)
        for role, seconds in list(self._cpu.values()):
            cpu[role] += seconds
        out = {f"{r}_cpu_s": round(v, 4) for r, v in cpu.items()}
        with self._lock:
            out["copy_wait_s"] = round(self._copy_wait, 4)
        return out

    @staticmethod
    def describe(report: Dict[str, float]) -> str:
        parts = ", ".join(f"{ROLE_LABELS[r]} {report[r + '_cpu_s']:.3f} s" for r in ROLES)
        return (f"capture's threads in the server's process used {parts} of CPU "
                f"(waiting for device copies {report['copy_wait_s']:.3f} s)")


def name_os_thread(name: str) -> None:
    """Give the calling thread its Python name in the OS too (Linux: 15 characters), so that
    `top -H` and /proc/PID/task show capture's threads apart from SGLang's."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass


# the CUDA caching allocator's slow paths (torch.cuda.memory_stats keys)
ALLOCATOR_KEYS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")


class AllocatorCounters:
    """How often the CUDA caching allocator took its slow paths in this process since capture
    started: a retry after freeing its cache, a sync of all streams, a device malloc or free.
    The side-stream copies keep the forward's memory from reuse until they finish
    (record_stream); should that push the allocator into these paths, SGLang's own forward slows
    where the hook's clock does not reach, and these counters show it."""

    def __init__(self) -> None:
        self._device: Optional[int] = None
        self._base: Dict[str, int] = {}

    def start(self) -> None:
        import torch  # the server's process has it; the CLI that reads reports need not

        if torch.cuda.is_available():
            self._device = torch.cuda.current_device()
            self._base = self._read()

    def _read(self) -> Dict[str, int]:
        import torch

        stats = torch.cuda.memory_stats(self._device)
        return {k: int(stats.get(k, 0)) for k in ALLOCATOR_KEYS}

    def report(self) -> Dict[str, int]:
        """The counts since start; empty without CUDA."""
        if self._device is None:
            return {}
        try:
            now = self._read()
        except Exception:  # at interpreter exit the CUDA context may be gone
            return {}
        return {k: now[k] - self._base.get(k, 0) for k in ALLOCATOR_KEYS}

    @staticmethod
    def describe(report: Dict[str, int]) -> str:
        if not report:
            return ""
        return ("; CUDA allocator since capture started: %d retries, %d syncs of all streams, %d device mallocs, "
                "%d device frees" % tuple(report[k] for k in ALLOCATOR_KEYS))
