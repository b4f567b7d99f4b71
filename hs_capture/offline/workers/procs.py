"""Worker processes for the offline tools (merge, verify).

They come from a fork server that imported the workers' module once, so N workers cost one
import, not N: torch takes seconds to import, and many spawned workers importing it at once
took most of a short merge's time. The server is a fresh process that only
imports (no thread, no torch op), so forking it is safe where forking a live torch process
is not. Started early, it imports while the caller plans. Spawn where there is no fork
server (not Linux/macOS).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

WORKER_MEMORY = 2 << 30  # above a merge worker's peak on 8k-token DeepSeek steps (benchmarks/README.md, merge.py)


def cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 2


def default_jobs() -> int:
    """Worker processes when none are asked for (merge, verify, send --check-data): one per
    core this process may use, at most one per WORKER_MEMORY of the memory available now."""
    try:
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return cores()
    return max(1, min(cores(), free // WORKER_MEMORY))


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
    """Start the fork server now (its imports overlap the caller's planning). It starts with
    SIGINT ignored, as do the workers it forks: a Ctrl-C reaches the whole process group, and
    the caller alone decides what it means (a worker or the fork server importing torch would
    each print a traceback)."""
    ctx = context(preload)
    if ctx.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        forkserver.ensure_running()
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # kept across exec: the server's Python ignores it
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, before)


def _worker_init(umask: int, initializer: Callable, initargs: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # spawned workers too: the caller handles Ctrl-C
    # the caller's, not the fork server's (started earlier, perhaps under another umask): what a
    # worker writes is no wider than what the caller would write
    os.umask(umask)
    initializer(*initargs)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def _interrupt_deferred() -> Iterator[None]:
    """Hold a Ctrl-C until the block is done, then raise it. multiprocessing's bookkeeping
    (its Finalize objects, made as the pool starts a worker) is not safe against an exception
    raised halfway: the half-made object prints a traceback when it is collected."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list = []
    before = signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before if before is not None else signal.default_int_handler)
        if held and callable(before):
            before(signal.SIGINT, held[0])
        elif held and before != signal.SIG_IGN:  # the default action, or the handler restored above
            signal.raise_signal(signal.SIGINT)


class _Pool(ProcessPoolExecutor):
    def submit(self, fn, /, *args, **kwargs):  # starts a worker when one is due
        with _interrupt_deferred():
            return super().submit(fn, *args, **kwargs)


@contextmanager
def pool(workers: int, preload: Sequence[str], initializer: Callable, initargs: tuple) -> Iterator[ProcessPoolExecutor]:
    """Worker processes for `with`. Leaving it by an exception (Ctrl-C in the caller) ends the
    workers at once instead of waiting for the tasks in flight, which could be most of the work."""
    start(preload)
    with _interrupt_deferred():
        ex = _Pool(workers, mp_context=context(preload), initializer=_worker_init,
                   initargs=(_umask(), initializer, initargs))
    try:
        yield ex
    except GeneratorExit:  # a generator over the pool closed once its caller had what it needed
        ex.shutdown(cancel_futures=True)
        raise
    except BaseException:
        _end(ex)
        raise
    ex.shutdown()


def _end(ex: ProcessPoolExecutor) -> None:
    """Stop a pool's workers now, tasks in flight included (their files are written whole or not
    at all: a re-run removes the temp files and redoes them), and the fork server: a worker it
    was asked for while still importing would start after this process has gone, and fail
    loudly on the pool's vanished queues. The next pool starts a new server."""
    stop = getattr(ex, "terminate_workers", None)  # Python 3.14+
    workers = [] if stop else list((getattr(ex, "_processes", None) or {}).values())
    if stop is not None:
        stop()
    for w in workers:
        w.terminate()
    from multiprocessing import forkserver

    server = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if server:
        try:
            os.kill(server, signal.SIGTERM)
        except OSError:
            pass
    if stop is None:
        ex.shutdown(wait=False, cancel_futures=True)
    for w in workers:
        w.join(5)
    # Let the pool's manager thread close its wake-up pipe before this process exits: Python
    # 3.11's exit hook writes to that pipe unlocked, and one closed under it prints a traceback.
    manager = getattr(ex, "_executor_manager_thread", None)
    if manager is not None and manager is not threading.current_thread():
        manager.join(5)
