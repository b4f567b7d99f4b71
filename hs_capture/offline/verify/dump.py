"""Verify dump dirs as the server wrote them, in this order: the runs and each rank's
metadata (runs.py), each rank's index against the disk (index.py), every step's files decoded
(steps.py: all of them, or a random `sample` of steps), then which samples are whole
(samples.py). Index-level checks are cheap and always cover everything."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from hs_capture.offline.read.planning import Plan
from hs_capture.offline.verify.index import Step, check_index
from hs_capture.offline.verify.pool import pick
from hs_capture.offline.verify.report import Report
from hs_capture.offline.verify.runs import check_runs
from hs_capture.offline.verify.samples import check_samples
from hs_capture.offline.verify.steps import Progress, check_steps


def verify_dump(paths: Sequence[str], report: Report, dataset: Optional[Dict[str, List[int]]] = None,
                sample: Optional[int] = None, jobs: int = 4, seed: int = 0,
                progress: Optional[Progress] = None) -> Optional[Plan]:
    """Every dump check; returns the samples' plan (for --reference) when there is one."""
    runs = check_runs(paths, report)
    steps: List[Step] = []
    for run in runs:
        steps += check_index(run, report)
    todo = pick(steps, sample, seed)
    report.stats.update(runs=len(runs), ranks=sum(len(r.ranks) for r in runs), steps=len(steps),
                        steps_decoded=len(todo))
    report.stats["bytes_read"] = check_steps(todo, report, dataset, jobs, progress)
    return check_samples(paths, steps, report,
                         {k: len(v) for k, v in dataset.items()} if dataset is not None else None)
