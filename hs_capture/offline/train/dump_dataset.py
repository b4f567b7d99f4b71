"""Train straight from a dump: torch datasets whose items are exactly what `hscap merge` would
write for each sample (the format's record()), decoded on the fly, so the disk holds the
dump alone and no merge pass runs first.

    DumpDataset(dumps, dataset=None, keys="hscap")               random access (map-style)
    DumpDataset(dumps, dataset=None, keys="hscap", follow=True)  live: follows a run as the
                                                                 server writes it (iterable)

Whole samples only, by the one completeness rule (planning.plan for a finished dump,
follow.Follower for a live one). keys: whose items ("specforge", "modelopt", "speculators",
"hscap": HsCaptureDataset's). A step file holds many samples: read the map-style dataset
through `ds.sampler(...)` (step_sampler.py) to decode each about once per epoch. The
map-style dataset reads what is committed when it opens: for a run still being written use
follow=True (without a dataset, the last request of a running rank may not be whole yet).
"""

from __future__ import annotations

import os
import time
import zlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from hs_capture.offline.read.assemble import Assembler, TokensDiffer, with_loss_mask
from hs_capture.offline.read.follow import Follower, Progress
from hs_capture.offline.formats import FORMATS, NAMES, TrainingFormat
from hs_capture.offline.read.inputs import BadLine, Inputs, load_inputs
from hs_capture.offline.read.planning import Plan, plan
from hs_capture.offline.read.reader import DumpError
from hs_capture.offline.train.step_sampler import RUN, StepWindowSampler, rank_world

Dumps = Union[str, Sequence[str]]
WINDOW_BYTES = 256 << 20  # decoded states per shuffle window (a worker caches it and the step before)
# a live reader's decode cache: samples become whole in step order, so a few steps suffice
FOLLOW_CACHE_BYTES = 2 * WINDOW_BYTES
STATE_VERSION = 2  # 2: follow.Progress (1: every id handed out, kept per worker)


def _format(keys: str) -> TrainingFormat:
    if keys not in FORMATS:
        raise ValueError(f"keys={keys!r}: choose from {NAMES}")
    return FORMATS[keys]


def _inputs(dataset: Optional[str]) -> Optional[Inputs]:
    if dataset is None:
        return None
    try:
        return load_inputs(dataset)
    except BadLine as e:
        raise DumpError(str(e)) from None
    except OSError as e:
        raise DumpError(f"{dataset}: {e.strerror or e}") from None


def _lengths(inputs: Optional[Inputs]) -> Optional[Dict[str, int]]:
    """The dataset's lengths: only its ids count, each to its full length."""
    return {k: len(v) for k, v in inputs.ids.items()} if inputs is not None else None


def _check(f: TrainingFormat, prenorm: bool, layers: List[int]) -> None:
    problem = f.problem(prenorm, layers)
    if problem:
        raise DumpError(problem)


def _item(f: TrainingFormat, asm: Assembler, rid: str, inputs: Optional[Inputs]) -> Dict[str, object]:
    try:
        s, mask = with_loss_mask(asm, rid, inputs, views=True)  # record() copies what it keeps
    except TokensDiffer as e:
        raise TokensDiffer(f"sample {rid!r}: {e} (is this the dataset the dump was captured from?)") from None
    except DumpError as e:
        where = "" if str(e).startswith("rid ") else f"sample {rid!r}: "
        raise DumpError(f"{where}{e} (hscap verify names every damaged sample)") from None
    return f.record(s, mask)


class DumpDataset(torch.utils.data.Dataset):
    """A finished dump (or several), random access; follow=True gives the live, iterable
    FollowingDumpDataset instead. DumpError: the dump or dataset cannot be used (one line)."""

    def __new__(cls, dumps: Dumps, dataset: Optional[str] = None, keys: str = "hscap", follow: bool = False,
                **kw: Any) -> Any:
        # a FollowingDumpDataset is a DumpDataset: Python then calls its __init__ with these arguments
        return super().__new__(FollowingDumpDataset if follow and cls is DumpDataset else cls)

    def __init__(self, dumps: Dumps, dataset: Optional[str] = None, keys: str = "hscap", follow: bool = False,
                 window_bytes: int = WINDOW_BYTES, check_data: int = 0) -> None:
        """check_data=N: decode every step first in N processes, as merge does, so a step whose
        bytes are damaged (not only short or missing: sizes show those) leaves its samples out of
        len and in `incomplete`; 0 (the default) opens at once, and such a sample fails when read."""
        self.format = _format(keys)
        self.keys = keys
        self.dumps = [dumps] if isinstance(dumps, str) else list(dumps)
        self.inputs = _inputs(dataset)
        self.plan: Plan = plan(self.dumps, _lengths(self.inputs), check_jobs=check_data)
        _check(self.format, self.plan.prenorm, self.plan.layers)
        # merge's rows: the dataset's order, else rid order, incomplete samples included
        order = self.inputs.order if self.inputs else sorted(set(self.plan.samples) | set(self.plan.incomplete))
        self._rows = {rid: row for row, rid in enumerate(order)}
        self.rids: List[str] = [rid for rid in order if rid in self.plan.samples]
        self._index = {rid: i for i, rid in enumerate(self.rids)}
        self.incomplete: Dict[str, str] = dict(self.plan.incomplete)  # rid -> why it is left out
        self.windows, self._steps = self._windows(window_bytes)
        largest = max((self._step_bytes(k) for k in self._steps), default=0)
        self.cache_bytes = window_bytes + 2 * largest  # a window, and the steps at its edges
        self._asm: Optional[Assembler] = None

    # ------------------------------------------------------------ the order
    def _token_bytes(self) -> int:
        return self.plan.hidden_size * (len(self.plan.layers) + 1 + self.plan.prenorm) * self.plan.itemsize

    def _step_bytes(self, key: Tuple[int, str, int]) -> int:
        return self._steps[key] * self._token_bytes()

    def _windows(self, window_bytes: int) -> Tuple[List[List[int]], Dict[tuple, int]]:
        """Indices grouped by the step that ends them, steps in dump order, cut into windows of
        about window_bytes of decoded states; and each step's tokens of this dataset."""
        steps: Dict[tuple, int] = {}
        ends: Dict[tuple, List[int]] = {}
        for i, rid in enumerate(self.rids):
            pieces = self.plan.samples[rid]
            for p in pieces:
                steps[(p.run, p.rank, p.step)] = steps.get((p.run, p.rank, p.step), 0) + p.length
            p = pieces[-1]
            ends.setdefault((p.run, p.rank, p.step), []).append(i)
        windows: List[List[int]] = [[]]
        have = 0
        for key in sorted(ends):
            if windows[-1] and have >= window_bytes:
                windows.append([])
                have = 0
            windows[-1] += ends[key]
            have += steps[key] * self._token_bytes()
        return [w for w in windows if w], steps

    def sampler(self, batch_size: int = 1, num_workers: int = 0, shuffle: bool = True, seed: int = 0,
                drop_last: bool = False, rank: Optional[int] = None, world_size: Optional[int] = None,
                run: int = RUN) -> StepWindowSampler:
        """The order to read this dataset in (step_sampler.py); batch_size and num_workers must
        be the DataLoader's; rank and world_size default to torch.distributed's."""
        return StepWindowSampler(self.windows, batch_size, num_workers, shuffle, seed, drop_last, rank, world_size,
                                 run)

    # ------------------------------------------------------------ the items
    def __len__(self) -> int:
        return len(self.rids)

    def row_of(self, rid: str) -> int:
        """The row merge gives this sample (its place in the dataset, else in rid order)."""
        return self._rows[rid]

    def __getitem__(self, i: int) -> Dict[str, object]:
        if self._asm is None:  # made in the process that reads (a DataLoader worker has its own)
            self._asm = Assembler(self.plan, self.cache_bytes)
        return _item(self.format, self._asm, self.rids[i], self.inputs)

    def by_id(self, rid: str) -> Dict[str, object]:
        return self[self._index[rid]]

    @property
    def bytes_decoded(self) -> int:
        """Raw state bytes this process decoded so far."""
        return self._asm.bytes_decoded if self._asm is not None else 0

    def __getnewargs__(self) -> Tuple[List[str]]:  # unpickling (spawned workers) calls __new__ with these
        return (self.dumps,)

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_asm"] = None  # a worker decodes into its own cache
        return state


class FollowingDumpDataset(torch.utils.data.IterableDataset, DumpDataset):
    """A run followed while the server writes it (follow.py): each whole sample once, as soon
    as it is whole; the dump dir need not exist yet. Ends when every run found has closed (or
    after `idle_timeout_s` without a new sample, or on stop()).

    One reader a rank: under DataLoader workers, worker 0 follows the dump and decodes every
    sample, and the other workers end at once. A DataLoader takes items from its workers in
    turn (in order, by default) and, once a worker has ended, from the others only, so no
    sample waits on a worker that has none: each comes one poll after it is whole, plus its
    decode. Sharing one order among several workers would need state shared between their
    processes (a leader, a log, a rendezvous of their states on restart, under fork and spawn)
    and would spread each step over every worker, each decoding it; one reader needs none of
    it, decodes each step once and holds its whole progress in its own state. One process
    decodes several times what one GPU's trainer takes (benchmarks/README.md, dump_dataset.py).
    Under torch.distributed each sample goes to one rank, by the step that ends it (each step
    decoded about once; the split is fixed when the dataset is made, in the trainer's process).
    The ranks' counts differ: under DDP stop at a step count or use torch's Join.

    state_dict()/load_state_dict(): what was handed out, as one position a rank of each run
    (follow.Progress), so a restarted trainer neither repeats nor skips a sample (torchdata's
    StatefulDataLoader calls them in each worker; restart with the same ranks). A request
    captured twice (a re-send) is handed out once, as first captured whole; one whose tokens
    differ from the dataset's is left out (`skipped`)."""

    def __init__(self, dumps: Dumps, dataset: Optional[str] = None, keys: str = "hscap", follow: bool = True,
                 poll_s: float = 0.5, idle_timeout_s: Optional[float] = None, rank: Optional[int] = None,
                 world_size: Optional[int] = None, cache_bytes: int = FOLLOW_CACHE_BYTES,
                 window_bytes: Optional[int] = None) -> None:
        """window_bytes (DumpDataset's setting): the decode cache holds two windows of it."""
        # a DumpDataset (isinstance holds), iterable: the map-style parts below do not apply
        self.format = _format(keys)
        self.keys = keys
        self.dumps = [dumps] if isinstance(dumps, str) else list(dumps)
        self.inputs = _inputs(dataset)
        self.poll_s, self.idle_timeout_s = poll_s, idle_timeout_s
        # here, in the trainer's process: a spawned DataLoader worker has no process group
        self.rank, self.world_size = rank_world(rank, world_size)
        self.cache_bytes = 2 * window_bytes if window_bytes else cache_bytes
        self._progress = Progress()
        self._stop = False
        self.bytes_decoded = 0
        self.skipped: Dict[str, str] = {}  # rid -> why it was left out

    bytes_decoded = 0  # an attribute here (DumpDataset's is a property of its decoder)

    def __len__(self) -> int:
        raise TypeError("a live DumpDataset (follow=True) has no length: it ends when the run closes")

    def __getitem__(self, i: int) -> Dict[str, object]:
        raise TypeError("a live DumpDataset (follow=True) is iterable, not indexed")

    def stop(self) -> None:
        """End the iteration after the sample being handed out (same process)."""
        self._stop = True

    def state_dict(self) -> Dict[str, object]:
        return {"version": STATE_VERSION, "read": self._progress.to_json()}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"a follow state of version {state.get('version')!r}: this hs_capture reads "
                             f"{STATE_VERSION}")
        self._progress = Progress.from_json(state["read"])

    def __iter__(self) -> Iterator[Dict[str, object]]:
        info = torch.utils.data.get_worker_info()
        if info is not None and info.id > 0:
            return  # one reader a rank: worker 0 (the class doc says why)
        progress = self._progress
        follower = Follower(self.dumps, _lengths(self.inputs), progress)
        p: Optional[Plan] = None
        asm: Optional[Assembler] = None
        idle_since = time.monotonic()
        closed = False
        self._stop = False
        while not self._stop:
            ready = follower.poll()
            if p is None and follower.runs and follower.layers:
                _check(self.format, follower.prenorm, follower.layers)
                p = Plan(follower.runs, follower.layers, follower.hidden_size, follower.prenorm)
                asm = Assembler(p, self.cache_bytes)
            for w in ready:
                run_id = os.path.basename(follower.runs[w.end[0]].path)  # the same on every node's mount
                if zlib.crc32(f"{run_id}|{w.end[1]}|{w.end[2]}".encode()) % self.world_size != self.rank:
                    progress.settle(w)  # another rank's
                    continue
                p.samples[w.rid] = w.pieces
                if w.borrows:
                    p.borrows[w.rid] = w.borrows
                before = asm.bytes_decoded
                try:
                    item = _item(self.format, asm, w.rid, self.inputs)
                except TokensDiffer as e:  # not this dataset's sample: merge leaves it out too
                    self.skipped[w.rid] = str(e)
                    progress.settle(w)
                    continue
                finally:
                    del p.samples[w.rid]
                    p.borrows.pop(w.rid, None)
                self.bytes_decoded += asm.bytes_decoded - before
                progress.settle(w)  # in the state before the item is handed out
                yield item
                if self._stop:
                    return
            if ready:
                idle_since = time.monotonic()
            if closed:
                return  # the poll after the close took the last lines
            closed = follower.close_check()
            if not closed:
                if self.idle_timeout_s is not None and time.monotonic() - idle_since > self.idle_timeout_s:
                    return
                time.sleep(self.poll_s)
