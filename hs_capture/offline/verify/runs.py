"""Verify a dump's runs and each writing rank's metadata: readable, one configuration, every
DP group present, capture never stopped, no failed step, closed, and its count of written
steps equal to its index's."""

from __future__ import annotations

import os
import time
from typing import Dict, List, Sequence, Tuple

from hs_capture.dump.paths import rank_meta_path
from hs_capture.dump.schema import RankMeta
from hs_capture.offline.read.reader import Run, open_runs
from hs_capture.offline.verify.report import WARNING, Report


def _config(meta: RankMeta) -> Tuple:
    return (tuple(meta.layers), meta.hidden_size, meta.num_layers, meta.prenorm, meta.model_path,
            meta.layer_convention)


def _config_text(key: Tuple) -> str:
    return f"layers={list(key[0])} hidden={key[1]} num_layers={key[2]} prenorm={key[3]} model={key[4]}"


def rel(run: Run, path: str) -> str:
    """A path as findings name it: from the dump dir that holds the run."""
    return os.path.relpath(path, os.path.dirname(run.path))


def check_runs(paths: Sequence[str], report: Report) -> List[Run]:
    runs: List[Run] = []
    for p in paths:
        errors: List[Tuple[str, str]] = []
        found = open_runs(p, errors)
        for path, msg in errors:
            report.add("runs", msg, path=path)
        if not found and not errors:
            report.add("runs", "no hs_capture run here (no ranks/*.json)", path=p)
        runs += [r for r in found if all(os.path.realpath(r.path) != os.path.realpath(x.path) for x in runs)]
    report.looked("runs", len(runs))
    configs: Dict[Tuple, List[str]] = {}
    for run in runs:
        for tag, meta in run.ranks.items():
            configs.setdefault(_config(meta), []).append(f"{os.path.basename(run.path)}/{tag}")
    report.looked("config", sum(len(v) for v in configs.values()))
    if len(configs) > 1:
        for key, where in configs.items():
            report.add("config", f"mixed configurations in one verify: {len(where)} rank(s) have {_config_text(key)} "
                                 f"(e.g. {where[0]}); merge refuses such a mix", path=where[0])
    for run in runs:
        _check_ranks(run, report)
    return runs


def _check_ranks(run: Run, report: Report) -> None:
    report.looked("ranks", len(run.ranks))
    dp_size = max(m.dp_size for m in run.ranks.values())
    present = {m.dp_rank for m in run.ranks.values()}
    for dp in sorted(set(range(dp_size)) - present):
        report.add("ranks", f"DP group {dp} of {dp_size} wrote no rank metadata: that rank's files are missing",
                   path=run.path)


def check_rank_meta(run: Run, tag: str, written: int, report: Report) -> None:
    """One rank's metadata: a capture stop, failed steps, its status and its step count
    (`written`: the steps its index lists as written)."""
    meta = run.ranks[tag]
    mpath = rel(run, rank_meta_path(run.path, tag))
    report.looked("dropped")
    stats, stopped = meta.stats, meta.capture_stopped
    if isinstance(stopped, dict):
        report.add("dropped", f"capture stopped at step {stopped.get('step')} "
                              f"({time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(stopped.get('time') or 0))} UTC): "
                              f"{stopped.get('reason')}; later prefills were not written", path=mpath)
    if stats.get("steps_failed"):
        report.add("dropped", f"the writer failed {stats['steps_failed']} step(s): {meta.last_failure}", path=mpath)
    report.looked("status")
    if meta.status != "closed":
        report.add("status", f"run status is {meta.status!r}, not 'closed': the server is still "
                             "running, or was killed (its last queued steps may be missing)", WARNING, mpath)
    elif stats.get("steps_written") is not None and int(stats["steps_written"]) != written:
        report.add("index", f"the metadata counts {stats['steps_written']} written steps, the index "
                            f"lists {written}", path=rel(run, run.index_path(tag)))
