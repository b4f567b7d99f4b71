"""`hscap merge`: dumps -> training-ready samples, streaming, resumable, shardable.

Rows: a sample's row is its place in the dataset (with --dataset) or in rid order, fixed
before any sharding, so `--shard i/N` merges on N machines produce disjoint, consistent
files. Work order: by first step, so samples that share steps are cut from one decode.
A file that exists is done (writes are atomic); leftover temp files are removed first.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .assemble import Assembler, Plan, plan
from .files import atomic_write
from .formats import FORMATS, NAMES, native
from .inputs import BadLine, Inputs, load_inputs
from .layout import MERGE_REPORT, TEMP_MARK
from .reader import DumpError, first_mismatch

REPORT = MERGE_REPORT
SHARD_RAW_BYTES = 1 << 30  # native shards: ~1 GB of raw states each (merge memory follows)


class MergeError(Exception):
    """Bad merge input: the message is the one line the CLI prints."""


@dataclass
class MergeResult:
    format: str
    written: int = 0
    skipped_existing: int = 0
    tokens: int = 0
    bytes_in: int = 0  # compressed bytes read from the dumps
    raw_bytes: int = 0  # decoded tensor bytes of the samples written
    bytes_out: int = 0
    seconds: float = 0.0
    loss_mask_source: str = "dataset"
    shard: str = "0/1"
    incomplete: Dict[str, str] = field(default_factory=dict)  # rid -> reason (never written)
    # rid -> pieces captured again (a retry, a re-send) beside the whole capture that was
    # written: a warning, never a reason to leave a sample out
    recaptured: Dict[str, int] = field(default_factory=dict)

    def add(self, other: "MergeResult") -> None:
        for k in ("written", "skipped_existing", "tokens", "bytes_in", "raw_bytes", "bytes_out"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.incomplete.update(other.incomplete)


def _rows(p: Plan, ds: Optional[Inputs]) -> List[Tuple[int, str]]:
    """Every sample's row, incomplete ones included, so rows never depend on what was captured."""
    order = ds.order if ds is not None else sorted(set(p.samples) | set(p.incomplete))
    return list(enumerate(order))


def _checked_sample(asm: Assembler, rid: str, ds: Optional[Inputs], res: MergeResult):
    """The assembled sample and its loss mask, or None (recorded in res.incomplete)."""
    try:
        s = asm.sample(rid)
    except DumpError as e:  # a file gone or corrupt since indexing: this sample only
        res.incomplete[rid] = f"unreadable: {e}"
        return None
    if ds is not None:
        want = ds.ids[rid]
        k = first_mismatch(s.input_ids.tolist(), want)
        if k is not None:
            res.incomplete[rid] = f"token ids differ from the dataset at position {k}"
            return None
    mask = ds.masks.get(rid) if ds is not None else None
    loss_mask = torch.tensor(mask, dtype=torch.int64) if mask is not None else torch.ones(len(s.input_ids), dtype=torch.int64)
    return s, loss_mask


def _work_shard(args) -> MergeResult:
    """Native format: one packed shard file per batch of rows."""
    p, path, items, ds, cache_bytes = args
    asm = Assembler(p, cache_bytes)
    res = MergeResult(native.FORMAT.name)
    if os.path.exists(path):
        res.skipped_existing += len(items)
        return res
    packed = []
    for row, rid in sorted(items, key=lambda it: (p.samples[it[1]][0].run, p.samples[it[1]][0].step)):
        got = _checked_sample(asm, rid, ds, res)
        if got is not None:
            packed.append((row, got[0], got[1]))
            res.written += 1
            res.tokens += len(got[0].input_ids)
            res.raw_bytes += got[0].raw_bytes
    if packed:
        res.bytes_out += native.write_shard(path, sorted(packed, key=lambda x: x[0]))
    res.bytes_in = asm.bytes_read
    return res


def _shard_batches(p: Plan, rows: List[Tuple[int, str]]) -> List[List[Tuple[int, str]]]:
    """Consecutive rows, cut when a shard would pass SHARD_RAW_BYTES (sizes from the plan)."""
    per_token = p.hidden_size * (len(p.layers) + 1 + p.prenorm) * 4  # float32 worst case
    batches: List[List[Tuple[int, str]]] = [[]]
    size = 0
    for item in rows:
        n = sum(pc.length for pc in p.samples[item[1]]) * per_token
        if batches[-1] and size + n > SHARD_RAW_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += n
    return [b for b in batches if b]


def _work(args) -> MergeResult:
    p, items, out_dir, fmt_name, ds, cache_bytes = args
    f = FORMATS[fmt_name]
    asm = Assembler(p, cache_bytes)
    res = MergeResult(fmt_name)
    for row, rid in items:
        path = os.path.join(out_dir, f.file_name(rid, row))
        if os.path.exists(path):
            res.skipped_existing += 1
            continue
        got = _checked_sample(asm, rid, ds, res)
        if got is None:
            continue
        s, loss_mask = got
        res.bytes_out += f.write(path, s, loss_mask)
        res.written += 1
        res.tokens += len(s.input_ids)
        res.raw_bytes += s.raw_bytes
    res.bytes_in = asm.bytes_read
    return res


def merge(dump_dirs: Sequence[str], out_dir: str, fmt_name: str, dataset: Optional[str] = None,
          jobs: int = 1, shard: Tuple[int, int] = (0, 1), cache_bytes: int = 2 << 30,
          on_progress: Optional[Callable[[MergeResult, int], None]] = None) -> MergeResult:
    training_format = FORMATS.get(fmt_name)
    if training_format is None:
        raise MergeError(f"unknown format {fmt_name!r}: choose from {NAMES}")
    t0 = time.monotonic()
    try:
        ds = load_inputs(dataset) if dataset else None
    except BadLine as e:
        raise MergeError(str(e)) from None
    p = plan(dump_dirs, {k: len(v) for k, v in ds.ids.items()} if ds else None)
    problem = training_format.problem(p.prenorm, p.layers)
    if problem:
        raise MergeError(problem)
    packed = training_format.file_name is None  # shards listed by an index (native), else a file per sample
    work_dir = os.path.join(out_dir, native.SHARD_DIR) if packed else out_dir
    os.makedirs(work_dir, exist_ok=True)
    for name in os.listdir(work_dir):  # a killed merge's half-written files
        if TEMP_MARK in name:
            os.remove(os.path.join(work_dir, name))
    i, n = shard
    rows = [(row, rid) for row, rid in _rows(p, ds) if row % n == i]
    mine = [(row, rid) for row, rid in rows if rid in p.samples]
    first_step = {rid: (pc[0].run, pc[0].rank, pc[0].step) for rid, pc in p.samples.items()}
    mine.sort(key=lambda item: first_step[item[1]])  # cache locality
    total = MergeResult(fmt_name, loss_mask_source="dataset" if ds else "all ones (no --dataset)",
                        shard=f"{i}/{n}")
    total.incomplete.update({rid: p.incomplete[rid] for _, rid in rows if rid in p.incomplete})
    total.recaptured.update({rid: len(p.extras[rid]) for _, rid in rows if rid in p.extras})
    per_job = cache_bytes // max(1, jobs)
    if packed:  # shard files hold fixed row batches, so a re-run finds them done
        batches = _shard_batches(p, sorted(mine))
        worker = _work_shard
        args = [(p, os.path.join(out_dir, native.shard_name(i, n, k)), b, ds, per_job) for k, b in enumerate(batches)]
    else:
        # contiguous runs of the step-ordered list per batch: samples that share a step stay
        # in one process and its cache (with -j 1, small batches only pace the progress line)
        chunk = 64 if jobs <= 1 else max(1, -(-len(mine) // jobs))
        worker = _work
        args = [(p, mine[k:k + chunk], out_dir, fmt_name, ds, per_job) for k in range(0, len(mine), chunk)]
    if jobs <= 1:
        for r in map(worker, args):
            total.add(r)
            if on_progress:
                on_progress(total, len(mine))
    else:
        # spawn, not fork: a forked torch process with live threads can deadlock
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for r in pool.map(worker, args):
                total.add(r)
                if on_progress:
                    on_progress(total, len(mine))
    if packed:
        native.write_index(out_dir, p.layers, p.hidden_size, p.prenorm)
    total.seconds = round(time.monotonic() - t0, 3)
    report = asdict(total)
    # what verify --reference needs to map aux blocks back to layers
    report.update(layers=p.layers, hidden_size=p.hidden_size, prenorm=p.prenorm)
    atomic_write(os.path.join(out_dir, REPORT), [json.dumps(report, indent=1, sort_keys=True).encode()], fsync=False)
    return total
