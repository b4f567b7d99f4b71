"""Verify each rank's index against itself and the disk: malformed, doubled, dropped and
missing steps, parts that differ from the run's, files the index lists that the disk lacks,
files no index line lists, temp files. A run that did not close cleanly leaves such debris
without damage: then they are warnings, and what they cost is judged per sample."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Set, Tuple

from hs_capture.dump.paths import DATA, TEMP_MARK, TENSOR_SUFFIX, step_parts
from hs_capture.dump.schema import IndexLine
from hs_capture.offline.read.reader import TORN, Run
from hs_capture.offline.verify.report import ERROR, WARNING, Report
from hs_capture.offline.verify.runs import check_rank_meta, rel


@dataclass
class Step:
    """One written step of one rank, as verify checks it."""
    run: Run
    rank: str
    line: IndexLine
    damaged: bool = False  # a file of it is missing or unreadable: merge cannot cut samples from it

    @property
    def key(self) -> Tuple[str, str, int]:
        return (os.path.basename(self.run.path), self.rank, self.line.step)


def check_index(run: Run, report: Report) -> List[Step]:
    """Per rank: its index lines, then its metadata's account of them; then the files on disk
    against what the index lists. Returns the steps that hold files."""
    clean = all(m.closed_cleanly for m in run.ranks.values())
    debris = ERROR if clean else WARNING
    why = "" if clean else " (the run did not close cleanly: debris of a crash or a full disk, or it is still running)"
    steps: List[Step] = []
    for tag in sorted(run.ranks):
        written = _check_rank_index(run, tag, report, steps, debris, why)
        check_rank_meta(run, tag, written, report)
    if run.ranks and not steps:
        report.add("runs", "the run captured nothing (no written step in any rank)", path=run.path)
    listed = {os.path.normpath(f.path) for st in steps for f in st.line.files.values()}
    missing = _check_files(run, listed, report, debris, why)
    for st in steps:
        if any(os.path.normpath(f.path) in missing for f in st.line.files.values()):
            st.damaged = True
    return steps


def _check_rank_index(run: Run, tag: str, report: Report, steps: List[Step], debris: str, why: str) -> int:
    """One rank's index lines: malformed, doubled, dropped and missing steps; the written ones
    go to `steps`. Returns how many steps the index says were written."""
    ipath = rel(run, run.index_path(tag))
    if not os.path.exists(run.index_path(tag)):
        report.add("index", "index file missing", path=ipath)
        return 0
    meta = run.ranks[tag]
    seen: Dict[int, int] = {}
    written = 0
    want = set(step_parts(meta.layers, meta.prenorm))
    for n, line, problem in run.index_entries(tag):
        if problem == TORN:
            report.add("index", TORN, WARNING, ipath)
            continue
        report.looked("index")
        if problem:
            report.add("index", f"line {n}: {problem}", path=ipath)
            continue
        step = line.step
        if step in seen:
            report.add("index", f"line {n}: step {step} listed twice (first on line {seen[step]})", path=ipath)
            continue
        seen[step] = n
        if not line.written:
            rids = sorted({str(r) for r in line.rids()})
            report.add("dropped", f"step {step} dropped by the writer ({line.dropped}): "
                                  f"{line.num_tokens} tokens of rids {rids[:5]}"
                                  f"{' ...' if len(rids) > 5 else ''} were not written", path=ipath)
            continue
        written += 1
        if set(line.files) != want:
            report.add("shapes", f"step {step}: parts {sorted(line.files)} differ from the run's {sorted(want)}",
                       path=ipath)
        steps.append(Step(run, tag, line))
    missing = sorted(set(range(max(seen) + 1)) - set(seen)) if seen else []
    if missing:
        report.add("index", f"{len(missing)} step(s) have no index line: {_ranges(missing)} "
                            "(lost in a crash, or the line was removed)" + why, debris, ipath)
    return written


def _ranges(xs: List[int]) -> str:
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}..{x}")
            start = None
    return ", ".join(out[:10]) + (" ..." if len(out) > 10 else "")


def _check_files(run: Run, listed: Set[str], report: Report, debris: str = ERROR, why: str = "") -> Set[str]:
    """Compare the index with the disk; returns the listed paths that are missing."""
    on_disk: Set[str] = set()
    for root, dirs, names in os.walk(run.path):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(root, name)
            path = os.path.relpath(full, run.path)
            if TEMP_MARK in name:
                report.add("files", "temp file left by an interrupted write" + why, debris, rel(run, full))
            elif path.startswith(DATA + os.sep) and name.endswith(TENSOR_SUFFIX):
                on_disk.add(os.path.normpath(path))
    report.looked("files", len(listed | on_disk))
    for path in sorted(listed - on_disk):
        report.add("files", "missing: the index lists it, the disk does not have it",
                   path=rel(run, os.path.join(run.path, path)))
    for path in sorted(on_disk - listed):
        report.add("files", "extra: on disk but in no index line (its index line is missing?)" + why, debris,
                   rel(run, os.path.join(run.path, path)))
    return listed - on_disk
