"""How verify reads in parallel: a random sample of the work, then either worker processes
(dump steps: each decoded and checked in one process, its findings sent back; threads in one
process did not scale with the cores) or a thread pool with a bounded window (merged
samples: at most 2 x jobs items decoded or queued at once). Memory stays at a few steps or
samples per worker whatever the dump's size."""

from __future__ import annotations

import random
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Deque, Iterator, List, Optional, Sequence, TypeVar

from hs_capture.offline.workers import procs

T = TypeVar("T")
R = TypeVar("R")


def pick(items: Sequence[T], sample: Optional[int], seed: int) -> List[T]:
    """All items, or `sample` of them chosen at random (reproducible with `seed`)."""
    if sample is None or sample >= len(items):
        return list(items)
    return random.Random(seed).sample(list(items), sample)


def bounded_map(fn: Callable[[T], R], items: Sequence[T], jobs: int,
                progress: Optional[Callable[[int, int], None]] = None) -> Iterator[R]:
    """fn over items in `jobs` threads, results in order, progress(done, total) after each."""
    jobs = max(1, jobs)
    window: Deque[Future] = deque()
    done = 0
    with ThreadPoolExecutor(jobs, thread_name_prefix="hscap-verify") as pool:
        for i, item in enumerate(items):
            window.append(pool.submit(fn, item))
            while window and (len(window) >= 2 * jobs or i == len(items) - 1):
                yield window.popleft().result()
                done += 1
                if progress:
                    progress(done, len(items))


def process_map(fn: Callable[[T], R], items: Sequence[T], jobs: int, preload: Sequence[str],
                initializer: Callable, initargs: tuple) -> Iterator[R]:
    """fn over items in `jobs` worker processes (procs.py), results in order. fn, the items
    and the results cross processes: all must pickle."""
    with procs.pool(max(1, min(jobs, len(items))), preload, initializer, initargs) as ex:
        yield from ex.map(fn, items)
