"""The order a DumpDataset is read in: shuffled, yet each step file decoded about once per epoch.

A step holds many samples (8192 tokens of a dozen requests), so a uniform shuffle decodes
each step once per sample it holds. Samples are grouped into windows of consecutive steps
(by the step that ends them, as merge walks them). A sample that starts in the step before
its window needs that step decoded too, unless the window before it was just read: so the
windows are read in runs of `run` consecutive windows, the runs in shuffled order and the
samples within each window shuffled, seeded by (seed, epoch). Each run then decodes one step
more than it holds: about 1 + 1/(run x steps per window) of the dump per epoch.
Under torch.distributed each rank takes a contiguous part of that order (equal counts,
padded by wrapping around as DistributedSampler does); under DataLoader workers, which take
batches round-robin, the batches are interleaved so each worker reads a contiguous part, and
its decode cache serves every sample of a window.
"""

from __future__ import annotations

import math
import random
from typing import Iterator, List, Optional, Sequence, Tuple

import torch


def rank_world(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """The given rank and world size, else torch.distributed's, else (0, 1)."""
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


# windows read in dump order before the next jump: each jump decodes one step twice, so the
# extra decode is ~1/(RUN x steps per window); the order is still shuffled across runs
RUN = 8


def epoch_order(windows: Sequence[Sequence[int]], epoch: int, seed: int, shuffle: bool, run: int = RUN) -> List[int]:
    """Every index once: runs of `run` consecutive windows in shuffled order, the samples
    within each window shuffled."""
    rng = random.Random(f"{seed}:{epoch}")
    runs = [list(range(k, min(k + run, len(windows)))) for k in range(0, len(windows), run)]
    if shuffle:
        rng.shuffle(runs)
    out: List[int] = []
    for w in (w for r in runs for w in r):
        members = list(windows[w])
        if shuffle:
            rng.shuffle(members)
        out += members
    return out


def rank_share(order: List[int], rank: int, world_size: int, drop_last: bool) -> List[int]:
    """This rank's contiguous share, every rank the same length."""
    n = len(order)
    if world_size == 1:
        return order
    if drop_last:
        per = n // world_size
    else:
        per = math.ceil(n / world_size)
        order = order + (order * math.ceil(per * world_size / max(1, n)))[: per * world_size - n]
    return order[rank * per:(rank + 1) * per]


def deal(batches: List, workers: int, first: int = 0) -> List:
    """Order batches so that DataLoader worker w, which takes batches w, w+N, w+2N, ..., reads
    one contiguous run of them; the runs are cut from `batches` for workers first, first+1, ...
    (mod N) in turn."""
    nb = len(batches)
    counts = [max(0, math.ceil((nb - w) / workers)) for w in range(workers)]
    runs, at = {}, 0
    for w in [(first + k) % workers for k in range(workers)]:
        runs[w] = batches[at:at + counts[w]]
        at += counts[w]
    return [runs[w][r] for r in range(counts[0]) for w in range(workers) if r < counts[w]]


def worker_interleave(share: List[int], batch_size: int, num_workers: int, drop_last: bool) -> List[int]:
    """`share` reordered so that each DataLoader worker reads a contiguous part of it, in the
    batches the DataLoader will cut from the order."""
    if num_workers <= 1:
        return share
    full = len(share) // batch_size
    batches = [share[k * batch_size:(k + 1) * batch_size] for k in range(full)]
    rest = share[full * batch_size:]
    if rest and not drop_last:
        batches.append(rest)
        rest = []
    if not batches:
        return share
    # the short last batch must come last: the run holding it (the share's end) goes to the
    # worker that takes the last batch
    last = (len(batches) - 1) % num_workers
    return [i for b in deal(batches, num_workers, first=(last + 1) % num_workers) for i in b] + rest


class StepWindowSampler(torch.utils.data.Sampler):
    """Indices of a DumpDataset in window order (module doc). `set_epoch` reshuffles, as
    DistributedSampler's does; batch_size and num_workers must be the DataLoader's."""

    def __init__(self, windows: Sequence[Sequence[int]], batch_size: int = 1, num_workers: int = 0,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, rank: Optional[int] = None,
                 world_size: Optional[int] = None, run: int = RUN) -> None:
        if batch_size < 1 or num_workers < 0:
            raise ValueError(f"batch_size {batch_size} / num_workers {num_workers}: need >= 1 / >= 0")
        self.windows = [list(w) for w in windows]
        self.batch_size, self.num_workers = batch_size, num_workers
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.rank, self.world_size = rank_world(rank, world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} of {self.world_size}")
        self.run = run
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def indices(self) -> List[int]:
        order = epoch_order(self.windows, self.epoch, self.seed, self.shuffle, self.run)
        share = rank_share(order, self.rank, self.world_size, self.drop_last)
        return worker_interleave(share, self.batch_size, self.num_workers, self.drop_last)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def __len__(self) -> int:
        n = sum(len(w) for w in self.windows)
        if self.world_size == 1:
            return n
        return n // self.world_size if self.drop_last else math.ceil(n / self.world_size)
