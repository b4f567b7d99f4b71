"""Worker processes for the offline tools (merge, verify).

They come from a fork server that imported the workers' module once, so N workers cost one
import, not N: torch alone takes ~3.5 s, and 16 spawned workers importing it at once took
5.4 s on a 16-core host, most of a 24-step merge. The server is a fresh process that only
imports (no thread, no torch op), so forking it is safe where forking a live torch process
is not. Started early, it imports while the caller plans. Spawn where there is no fork
server (not Linux/macOS).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Sequence


def cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 2


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM; 0 where /proc has none): what a worker
    reports back, since a pool's workers are not the caller's children."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def context(preload: Sequence[str]):
    """The multiprocessing context for workers that import `preload` (module names)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def start(preload: Sequence[str]) -> None:
    """Start the fork server now (its imports overlap the caller's planning)."""
    ctx = context(preload)
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()


def pool(workers: int, preload: Sequence[str], initializer: Callable, initargs: tuple) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(workers, mp_context=context(preload), initializer=initializer, initargs=initargs)
