"""`hscap merge`: dumps -> training-ready samples, streaming, resumable, shardable.

Rows: a sample's row is its place in the dataset (with --dataset) or in rid order, fixed
before any sharding, so `--shard i/N` merges on N machines produce disjoint, consistent
files. Work order: by the step that ends each sample, cut into one contiguous run per
worker, so every step is decoded about once whatever -j (see "work order" below). A file
that exists is done (writes are atomic); leftover temp files are removed first.
This module plans and hands out the runs without importing torch; merge_worker.py cuts the
samples and writes them, in procs.py's worker processes at -j > 1.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from functools import partial
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hs_capture.offline.workers import procs
from hs_capture.offline.read.attribution import unattributed
from hs_capture.dump import quant  # no torch until a function of it runs
from hs_capture.dump.files import atomic_write
from hs_capture.offline.formats import FORMATS, NAMES, Output, TrainingFormat
from hs_capture.offline.read.inputs import BadLine, Inputs, load_inputs
from hs_capture.dump.paths import MERGE_REPORT, TEMP_MARK
from hs_capture.offline.merge.merge_result import Item, MergeResult
from hs_capture.offline.merge.output_dir import REPORTS, SETTINGS, OutputDirError, prepare, record
from hs_capture.offline.read.planning import Plan, plan
from hs_capture.dump.layer_ids import ServedIds, family_of, served_ids

REPORT = MERGE_REPORT
WORKER = "hs_capture.offline.merge.merge_worker"  # decodes and writes; the only part that imports torch


class MergeError(Exception):
    """Bad merge input: the message is the one line the CLI prints."""


def _rows(p: Plan, ds: Optional[Inputs]) -> List[Tuple[int, str]]:
    """Every sample's row, incomplete ones included, so rows never depend on what was captured."""
    order = ds.order if ds is not None else sorted(set(p.samples) | set(p.incomplete))
    return list(enumerate(order))


# ----------------------------------------------------------------- work order
# Samples are taken in the order of the step that ends them, so a worker walks the dump's
# steps once: under chunked prefill a sample continues into the next step, and the samples
# of one step form a chain with their neighbours. A run of that order is one worker's; only
# the step where two runs meet is decoded twice, so the dump is read about once whatever -j.


def _step_order(p: Plan, items: List[Item]) -> List[Item]:
    def key(item: Item):
        pcs = p.samples[item[1]]
        return (pcs[-1].run, pcs[-1].rank, pcs[-1].step, pcs[0].run, pcs[0].rank, pcs[0].step, item[0])

    return sorted(items, key=key)


def _token_bytes(p: Plan, itemsize: int) -> int:
    """Decoded bytes of one token's captured states (every layer, the final, the pre-norm)."""
    return p.hidden_size * (len(p.layers) + 1 + p.prenorm) * itemsize


def _raw_size(p: Plan, rid: str) -> int:
    """A sample's decoded bytes, float32 worst case (sizes from the plan: nothing read)."""
    return sum(pc.length for pc in p.samples[rid]) * _token_bytes(p, 4)


def _runs(seq: List, target: float, size: Callable[[object], int],
          key: Optional[Callable[[object], object]] = None) -> List[List]:
    """Consecutive runs of `seq` of about `target` (each at least `target`, the last maybe
    less), cut only between neighbours whose `key` differs (when given)."""
    runs: List[List] = [[]]
    have, last = 0, None
    for x in seq:
        k = key(x) if key else None
        if runs[-1] and have >= target and (key is None or k != last):
            runs.append([])
            have = 0
        runs[-1].append(x)
        have += size(x)
        last = k
    return [r for r in runs if r]


def _end_step(p: Plan, rid: str) -> Tuple[int, str, int]:
    """The step that ends a sample: (run, rank, step)."""
    pc = p.samples[rid][-1]
    return (pc.run, pc.rank, pc.step)


def _cut(p: Plan, items: List[Item], target: float) -> List[List[Item]]:
    """Runs of step-ordered items of about `target` bytes, cut only between samples that end
    in different steps (a step's samples share its decode)."""
    return _runs(items, target, lambda item: _raw_size(p, item[1]), lambda item: _end_step(p, item[1]))


def _step_raw_bytes(p: Plan) -> int:
    """The largest step's decoded bytes in 2-byte floats (bf16, what servers store)."""
    tokens: Dict[Tuple[int, str, int], int] = {}
    for pcs in p.samples.values():
        for pc in pcs:
            tokens[(pc.run, pc.rank, pc.step)] = tokens.get((pc.run, pc.rank, pc.step), 0) + pc.length
    return max(tokens.values(), default=0) * _token_bytes(p, 2)


def merge(dump_dirs: Sequence[str], out_dir: str, fmt_name: str, dataset: Optional[str] = None,
          jobs: int = 1, shard: Tuple[int, int] = (0, 1), cache_bytes: int = 2 << 30,
          on_progress: Optional[Callable[[MergeResult, int], None]] = None, overwrite: bool = False) -> MergeResult:
    training_format = FORMATS.get(fmt_name)
    if training_format is None:
        raise MergeError(f"unknown format {fmt_name!r}: choose from {NAMES}")
    try:
        prepare(out_dir, dump_dirs, training_format, overwrite)
    except OutputDirError as e:
        raise MergeError(str(e)) from None
    t0 = time.monotonic()
    if jobs > 1:
        procs.start([WORKER])  # the workers' imports (torch) run while this process plans
    try:
        ds = load_inputs(dataset) if dataset else None
    except BadLine as e:
        raise MergeError(str(e)) from None
    p = plan(dump_dirs, {k: len(v) for k, v in ds.ids.items()} if ds else None)
    problem = training_format.problem(p.prenorm, p.layers)
    if problem:
        raise MergeError(problem)
    _remove_temp_files(os.path.join(out_dir, training_format.data_dir))
    i, n = shard
    rows = [(row, rid) for row, rid in _rows(p, ds) if row % n == i]
    total = MergeResult(fmt_name, loss_mask_source="dataset" if ds else "all ones (no --dataset)", shard=f"{i}/{n}")
    total.incomplete.update({rid: p.incomplete[rid] for _, rid in rows if rid in p.incomplete})
    total.recaptured.update({rid: len(p.extras[rid]) for _, rid in rows if rid in p.extras})
    total.left_out.update(p.left_out)  # not a user request: not a row either
    in_shard = {rid for _, rid in rows}
    total.unattributed = [rid for rid in unattributed(p.samples) if rid in in_shard] if ds is None else []
    mine = _step_order(p, [(row, rid) for row, rid in rows if rid in p.samples])
    outputs = training_format.plan_outputs(mine, shard, partial(_cut, p))
    record(out_dir, [out.path for out in outputs] + list(REPORTS) + list(training_format.listings))
    # each worker's cache holds at least the steps one sample crosses (a few full steps)
    per_job = max(cache_bytes // max(1, jobs), 2 * _step_raw_bytes(p))
    _execute(_tasks(p, outputs, jobs), (p, out_dir, fmt_name, ds, per_job, jobs), jobs, total, len(mine), on_progress)
    training_format.finish(out_dir, p.layers, p.hidden_size, p.prenorm)
    served = _served(p, training_format)
    total.warnings += [w for w in (training_format.dtype_warning(total.dtypes), served and served.problem())
                       if w]
    total.seconds = round(time.monotonic() - t0, 3)
    _write_reports(out_dir, total, p, training_format, ds, served)
    return total


def _served(p: Plan, training_format: TrainingFormat) -> Optional[ServedIds]:
    """The layer ids that the engine serving this format's drafters maps onto the captured
    layers: SGLang's rule for the captured family, at the release that captured (most likely
    the one that serves), or vLLM's."""
    if training_format.served_by is None or not p.runs:
        return None
    meta = p.runs[-1].meta
    return served_ids(p.layers, training_format.served_by, family_of(meta), meta.sglang_version)


def _remove_temp_files(work_dir: str) -> None:
    """A killed merge's half-written files (a finished file is never a temp file)."""
    os.makedirs(work_dir, exist_ok=True)
    for name in os.listdir(work_dir):
        if TEMP_MARK in name:
            os.remove(os.path.join(work_dir, name))


def _tasks(p: Plan, outputs: List[Output], jobs: int) -> List[List[Output]]:
    """The workers' tasks: step-ordered runs of the planned outputs (a file per sample, or
    shards of many), cut only between outputs whose last samples end in different steps."""
    def size(out: Output) -> int:
        return sum(_raw_size(p, rid) for _, rid in out.rows)

    def end(out: Output) -> Tuple[int, str, int]:
        return _end_step(p, out.rows[-1][1])

    if jobs > 1:  # about equal bytes each
        return _runs(outputs, sum(size(out) for out in outputs) / jobs, size, end)
    # one process: small runs only pace the progress line (its cache carries over)
    runs = _runs(outputs, 0, size, end)
    return [sum(runs[k:k + 8], []) for k in range(0, len(runs), 8)]


def _worker():
    from hs_capture.offline.merge import merge_worker  # imports torch: here only when a task runs in this process

    return merge_worker


def _start(*init) -> None:
    _worker().init(*init)


def _run(task: List[Output]) -> MergeResult:
    return _worker().write(task)


def _execute(tasks: List[List[Output]], init: tuple, jobs: int, total: MergeResult, n_samples: int,
             on_progress: Optional[Callable[[MergeResult, int], None]]) -> None:
    def collect(results) -> None:
        for r in results:
            total.add(r)
            if on_progress:
                on_progress(total, n_samples)

    if jobs <= 1:
        _start(*init)
        try:
            collect(map(_run, tasks))
        finally:
            _worker().clear()
        return
    with procs.pool(min(jobs, max(1, len(tasks))), [WORKER], _start, init) as pool:
        collect(pool.map(_run, tasks))


def _earlier_report(out_dir: str, fmt: str) -> dict:
    """The report an earlier run in this format left here (a resume, another --shard), or {}."""
    try:
        with open(os.path.join(out_dir, REPORT)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) and doc.get("format") == fmt else {}


def _stored_as(p: Plan) -> Optional[str]:
    """The compact tier's scheme where any state merged from these dumps was stored in it (the
    merged values carry its rounding: verify --reference allows for it), else None (lossless)."""
    fp8 = any(pc.dtype == quant.STORED_DTYPE for pcs in p.samples.values() for pc in pcs)
    return quant.SCHEME if fp8 else None


def _write_reports(out_dir: str, total: MergeResult, p: Plan, training_format: TrainingFormat,
                   ds: Optional[Inputs], served: Optional[ServedIds]) -> None:
    """merge_report.json (what verify --reference needs to map aux blocks back to layers, and
    `stored_as` where the source was the compact tier: what its rule allows for), and
    the trainer's settings that match the capture. Both say what the directory holds: an
    earlier run's counts and warnings are kept, this run's added (a re-run over finished output
    writes nothing new and must not erase the record)."""
    earlier = _earlier_report(out_dir, training_format.name)
    real_mask = ds is not None and any(m is not None for m in ds.masks.values())
    settings = training_format.settings(served.ids, real_mask) if served is not None else None
    warnings = list(dict.fromkeys([*(earlier.get("warnings") or []), *total.warnings]))
    if settings is not None:
        total.settings = settings
        total.serving = served.as_dict()
        note = served.note()
        if note and note not in warnings:
            warnings.append(note)
            total.warnings.append(note)
        doc = {"format": training_format.name, "captured_layers_entering": p.layers, "settings": total.settings,
               "served_by": total.serving, "warnings": warnings}
        atomic_write(os.path.join(out_dir, SETTINGS), [json.dumps(doc, indent=1).encode()], fsync=False)
    report = asdict(total)
    for key in ("written", "tokens", "raw_bytes", "bytes_out"):
        report[key] += int(earlier.get(key) or 0)
    whole_now = {rid: why for rid, why in (earlier.get("incomplete") or {}).items() if rid not in p.samples}
    report["incomplete"] = {**whole_now, **total.incomplete}
    report["dtypes"] = sorted(set(earlier.get("dtypes") or []) | set(total.dtypes))
    report.update(warnings=warnings, layers=p.layers, hidden_size=p.hidden_size, prenorm=p.prenorm)
    stored_as = earlier.get("stored_as") or _stored_as(p)
    if stored_as:  # only for the compact tier: a lossless source's report stays as it was
        report["stored_as"] = stored_as
    atomic_write(os.path.join(out_dir, REPORT), [json.dumps(report, indent=1, sort_keys=True).encode()], fsync=False)
