"""`hscap verify`: prove dumps and merged datasets complete, intact and sane.

    dump.py       dump dirs, in order: runs.py (runs, rank metadata), index.py (index lines,
                  files on disk), steps.py (every file decoded, in worker processes),
                  samples.py (which samples are whole)
    merged.py     merge output of every format
    reference.py  recompute samples with transformers and compare
    values.py     NaN/Inf, zero, constant and identical-tensor checks
    report.py     findings and the summary table / JSON; pool.py the step sample and workers

Never imports sglang; torch and transformers only when a check needs them.
"""

from __future__ import annotations

import os
import random
from typing import Callable, Dict, List, Optional, Sequence

from hs_capture.dump.paths import holds_dump
from hs_capture.offline.verify.dump import verify_dump
from hs_capture.offline.verify.merged import is_merged, verify_merged
from hs_capture.offline.verify.report import CHECKS, ERROR, WARNING, Finding, Report

__all__ = ["verify", "Report", "Finding", "CHECKS", "ERROR", "WARNING"]


def verify(paths: Sequence[str], dataset: Optional[Dict[str, List[int]]] = None, order: Optional[List[str]] = None,
           sample: Optional[int] = None, jobs: int = 4, seed: int = 0, reference: Optional[str] = None,
           reference_samples: int = 4, atol: Optional[float] = None, rtol: Optional[float] = None,
           layers: Optional[List[int]] = None, progress: Optional[Callable[[str, int, int], None]] = None,
           reference_device: str = "cpu") -> Report:
    """Run every check on dump dirs and/or merged dirs. `dataset`: id -> token ids;
    `order`: the dataset's ids in row order (speculators files are named by row).
    atol/rtol: fixed --reference bounds; both None = by the stored dtype (reference.py)."""
    report = Report(list(paths))
    merged = [p for p in paths if is_merged(p)]
    # a dump is checked wherever one is: merged output written into it must not hide its damage
    dumps = [p for p in paths if p not in merged or holds_dump(p)]
    planned = None
    if dumps:
        planned = verify_dump(dumps, report, dataset, sample, jobs, seed,
                              (lambda d, t: progress("dump", d, t)) if progress else None)
    items = []
    if merged:
        items = verify_merged(merged, report, dataset, order, sample, jobs, seed,
                              (lambda d, t: progress("merged", d, t)) if progress else None)
    if reference:
        from hs_capture.offline.verify.reference import Reference, Tolerance, compare

        ref = Reference(reference, reference_device)
        rng = random.Random(seed)
        tol = Tolerance(atol, rtol)
        if planned is not None:
            compare(report, ref, _dump_samples(planned, reference_samples, rng), tol)
        if merged:
            compare(report, ref, _merged_samples(merged, items, layers, reference_samples, rng, report), tol)
    return report


def _dump_samples(p, k: int, rng: random.Random):
    """k random whole samples of the plan the coverage check made (no second planning pass)."""
    from hs_capture.offline.read.assemble import Assembler
    from hs_capture.offline.read.reader import DumpError
    from hs_capture.offline.verify.reference import Stored

    asm = Assembler(p, cache_bytes=256 << 20)
    for rid in rng.sample(sorted(p.samples), min(k, len(p.samples))):
        try:
            s = asm.sample(rid)
        except DumpError:
            continue  # the file checks report it
        yield Stored(rid, os.path.basename(p.runs[p.samples[rid][0].run].path), s.input_ids.numpy(),
                     {k: v.float().numpy() for k, v in s.layers.items()}, s.final.float().numpy(),
                     s.prenorm.float().numpy() if s.prenorm is not None else None,
                     _stored_dtype(p.samples[rid], str(s.final.dtype).replace("torch.", "")),
                     {pc.prefix: pc.step for pc in p.samples[rid]})


def _stored_dtype(pieces, read: str) -> str:
    """What the server stored a sample's states as: its index lines' dtype where any piece is in
    the compact tier (the readers hand those out dequantized, as `read`), else `read`."""
    from hs_capture.dump import quant

    return quant.STORED_DTYPE if any(pc.dtype == quant.STORED_DTYPE for pc in pieces) else read


def _merged_samples(merged: Sequence[str], items, layers: Optional[List[int]], k: int, rng: random.Random,
                    report: Report):
    from hs_capture.offline.verify.merged import load_item
    from hs_capture.offline.verify.reference import Stored

    if layers is None:
        found = {tuple(r.get("layers") or ()) for r in report.stats.get("merge_reports", [])}
        found.discard(())
        if len(found) != 1:
            report.add("reference", "the merged output does not record its layers (no merge_report.json): "
                                    "pass --layers", path=",".join(merged))
            return
        layers = list(found.pop())
    headers: dict = {}
    for it in rng.sample(items, min(k, len(items))):
        try:
            s = load_item(it, headers)
        except Exception:
            continue  # the sample checks report unreadable files
        h = s.hidden_size
        if s.aux.shape[1] != h * len(layers):
            report.add("reference", f"aux holds {s.aux.shape[1] // h} layers, --layers names {len(layers)}",
                       path=it.path, rid=s.rid)
            continue
        states = {layer: s.aux[:, j * h:(j + 1) * h] for j, layer in enumerate(sorted(layers))}
        yield Stored(s.rid or it.path, it.path, s.input_ids, states, s.final, s.prenorm,
                     _merged_dtype(s.dtype, [*states.values(), s.final, s.prenorm]))


def _merged_dtype(read: str, states) -> str:
    """What a merged sample's states were stored as in the dump, told by their values: the
    compact tier's are all exact FP8 values dequantized (whatever merge_report.json says, so
    a merge of fp8 and lossless dumps, or one without its report, is judged sample by sample)."""
    from hs_capture.dump import quant

    present = [x for x in states if x is not None]
    return quant.STORED_DTYPE if present and all(quant.on_grid(x) for x in present) else read
