"""Verify `hscap merge` output in any of its formats: every sample present, loadable, with
its format's keys, dtypes and shapes, token ids equal to the dataset, and sane values.

Each format finds its own samples and reads them back (hs_capture.offline.formats: the native
format through its index.json, the others by their file names); merge_report.json, when
there, says which samples merge left out and why and the hidden size the readers check.
Torch files are opened with weights_only=True: nothing read is ever unpickled as code."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from hs_capture.dump import hst as fmt
from hs_capture.offline.formats import FORMATS, ListingError, MergedSample, SampleRef
from hs_capture.dump.paths import MERGE_REPORT, TEMP_MARK
from hs_capture.offline.read.reader import first_mismatch
from hs_capture.offline.verify.pool import bounded_map, pick
from hs_capture.offline.verify.report import Report
from hs_capture.offline.verify.values import identical_pairs, value_problems

Item = SampleRef  # one merged sample to check: where it is and how its format reads it


def is_merged(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MERGE_REPORT)) or any(f.marks(path) for f in FORMATS.values())


def _merge_report(root: str, report: Report) -> Tuple[Dict[str, str], Optional[int]]:
    """From merge_report.json, when there: rid -> reason for samples merge reported
    incomplete, and the hidden size it recorded."""
    rpath = os.path.join(root, MERGE_REPORT)
    if not os.path.isfile(rpath):
        return {}, None
    try:
        with open(rpath) as f:
            rep = json.load(f)
        incomplete = {str(k): str(v) for k, v in (rep.get("incomplete") or {}).items()}
        keys = ("format", "shard", "layers") + (("stored_as",) if "stored_as" in rep else ())
        report.stats.setdefault("merge_reports", []).append({k: rep.get(k) for k in keys})
    except (OSError, ValueError, AttributeError) as e:
        report.add("samples", f"merge report unreadable: {e}", path=rpath)
        return {}, None
    hidden = rep.get("hidden_size")
    return incomplete, hidden if isinstance(hidden, int) and not isinstance(hidden, bool) else None


def discover(root: str, report: Report, order: Optional[List[str]]) -> Tuple[List[Item], Dict[str, str]]:
    """Items under a merged dir, and rid -> reason for samples merge reported incomplete."""
    incomplete, hidden = _merge_report(root, report)
    files: List[str] = []
    for dirpath, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(dirpath, name)
            if TEMP_MARK in name:
                report.add("files", "temp file left by an interrupted merge", path=full)
            else:
                files.append(full)
    items: List[Item] = []
    for f in FORMATS.values():
        try:
            found = f.discover(root, files, lambda message, path: report.add("files", message, path=path), order)
        except ListingError as e:
            report.add("samples", e.reason, path=e.path)
            continue
        # the readers check the states' width against the hidden size the merge recorded
        items += [replace(r, hidden_size=hidden) if r.hidden_size is None and hidden is not None else r
                  for r in found]
    return items, incomplete


# ----------------------------------------------------------------- loading
def load_item(item: Item, headers: Dict) -> MergedSample:
    """Read one merged sample through its format. KeyError / hst.FormatError: wrong layout."""
    s = FORMATS[item.fmt].load(item, headers)
    if s.rid is None:
        s.rid = item.rid  # the format's file does not carry it: known from its name or the index
    return s


# ----------------------------------------------------------------- checks
def check_item(item: Item, report: Report, dataset: Optional[Dict[str, List[int]]],
               headers: Dict, seen: Dict[str, str]) -> Optional[MergedSample]:
    """Load one merged sample and check it; the sample, or None when it cannot be used."""
    report.looked("samples")
    s = _load_checked(item, report, headers)
    if s is None:
        return None
    rid = s.rid
    if rid is not None:
        with report._lock:
            other = seen.setdefault(rid, item.path)
        if other != item.path:
            report.add("samples", f"the sample is also in {other}", path=item.path, rid=rid)
    report.looked("shapes")
    problems = _shape_problems(s)
    for p in problems:
        report.add("shapes", p, path=item.path, rid=rid)
    if problems:
        return None
    _check_values(s, item.path, report)
    if dataset is not None and rid is not None and rid not in dataset:
        report.add("tokens", "not in the dataset (checked against another dataset?)", path=item.path, rid=rid)
    elif dataset is not None and rid is not None:
        report.looked("tokens")
        want, have = dataset[rid], s.input_ids.tolist()
        k = first_mismatch(have, want)
        if k is not None:
            report.add("tokens", f"token ids differ from the dataset at position {k} "
                                 f"(lengths {len(have)} vs {len(want)})", path=item.path, rid=rid)
    return s


def _load_checked(item: Item, report: Report, headers: Dict) -> Optional[MergedSample]:
    """load_item, with each way a file can be broken reported under its check."""
    try:
        return load_item(item, headers)
    except fmt.Truncated as e:
        report.add("truncated", str(e), path=item.path)
    except (fmt.ChecksumMismatch, fmt.CodecError, fmt.SizeMismatch) as e:
        report.add("checksum", str(e), path=item.path)
    except fmt.FormatError as e:
        report.add("header", f"{type(e).__name__}: {e}", path=item.path)
    except KeyError as e:
        report.add("samples", f"lacks key {e} of the {item.fmt} format", path=item.path, rid=item.rid)
    except Exception as e:  # torch.load on a damaged file: RuntimeError, EOFError, pickle errors
        first = str(e).splitlines()[0][:200] if str(e) else ""
        report.add("header", f"cannot load as {item.fmt}: {type(e).__name__}: {first}", path=item.path)
    return None


def _shape_problems(s: MergedSample) -> List[str]:
    t, h = len(s.input_ids), s.hidden_size
    problems = []
    if s.aux.ndim != 2 or s.aux.shape[0] != t or s.aux.shape[1] % h:
        problems.append(f"aux is {list(s.aux.shape)}, not ({t}, K*{h})")
    for name, a in (("final", s.final), ("prenorm", s.prenorm)):
        if a is not None and tuple(a.shape) != (t, h):
            problems.append(f"{name} is {list(a.shape)}, not ({t}, {h})")
    if s.loss_mask is not None:
        if s.loss_mask.shape != (t,):
            problems.append(f"loss_mask is {list(s.loss_mask.shape)}, not ({t},)")
        elif not np.isin(s.loss_mask, (0, 1)).all():
            problems.append("loss_mask holds values other than 0 and 1")
    return problems


def _check_values(s: MergedSample, path: str, report: Report) -> None:
    """Non-finite, degenerate and duplicated states, per captured state of the sample."""
    h = s.hidden_size
    named = {f"aux[{j}]": s.aux[:, j * h:(j + 1) * h] for j in range(s.aux.shape[1] // h)}
    if s.final is not None:
        named["final"] = s.final
    if s.prenorm is not None:
        named["prenorm"] = s.prenorm
    report.looked("nonfinite")
    report.looked("degenerate")
    for name, a in named.items():
        for check, msg in value_problems(a):
            report.add(check, f"{name}: {msg}", path=path, rid=s.rid)
    report.looked("identical")
    for a, b in identical_pairs(named):
        report.add("identical", f"{a} and {b} are bit-identical (the same layer written twice?)", path=path, rid=s.rid)


def verify_merged(paths: Sequence[str], report: Report, dataset: Optional[Dict[str, List[int]]] = None,
                  order: Optional[List[str]] = None, sample: Optional[int] = None, jobs: int = 4, seed: int = 0,
                  progress: Optional[Callable[[int, int], None]] = None) -> List[Item]:
    items: List[Item] = []
    incomplete: Dict[str, str] = {}
    for p in paths:
        got, inc = discover(p, report, order)
        items += got
        incomplete.update(inc)
    if not items:
        *most, last = [f.pattern for f in FORMATS.values()]
        report.add("samples", f"no merged sample found (no {', '.join(most)} or {last})", path=",".join(paths))
    report.looked("coverage", len(items) + len(incomplete))
    for rid, reason in sorted(incomplete.items()):
        report.add("coverage", f"left out by merge: {reason}", rid=rid)
    if dataset is not None:
        present = {i.rid for i in items if i.rid is not None}
        unknown = [i for i in items if i.rid is None]
        if not unknown:
            for rid in (order or sorted(dataset)):
                if rid not in present and rid not in incomplete:
                    report.add("coverage", "missing from the merged output", rid=rid)
    todo = pick(items, sample, seed)
    report.stats.update(merged_files=len({i.path for i in items}), samples=len(items), samples_checked=len(todo),
                        formats=sorted({i.fmt for i in items}))
    headers: Dict = {}  # the formats' memo across loads (native: shard headers)
    seen: Dict[str, str] = {}
    for _ in bounded_map(lambda it: check_item(it, report, dataset, headers, seen), todo, jobs, progress):
        pass
    if dataset is not None and unknown and len(todo) == len(items):
        # samples named by row carry their id inside: every one was read, so the ids are known now
        for rid in (order or sorted(dataset)):
            if rid not in seen and rid not in incomplete:
                report.add("coverage", "missing from the merged output", rid=rid)
    return items
