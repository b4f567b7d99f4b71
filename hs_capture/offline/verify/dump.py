"""Verify dump dirs as the server wrote them: metadata, index, files, bytes, values, coverage.

Index-level checks (cheap) always cover everything; the step pass decodes every file (or a
random `sample` of steps) through pool.bounded_map."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import numpy as np

from hs_capture.dump import hst as fmt
from hs_capture.offline.planning import MixedRuns, Plan, plan
from hs_capture.offline.coverage import Span, describe_extra
from hs_capture.offline.heap import keep_large_buffers
from hs_capture.offline.procs import peak_rss_bytes
from hs_capture.dump.paths import FINAL, TEMP_MARK, TENSOR_SUFFIX, step_parts
from hs_capture.offline.reader import TORN, DumpError, Run, first_mismatch, open_runs
from hs_capture.offline.verify.pool import pick, process_map
from hs_capture.offline.verify.report import ERROR, WARNING, Finding, Report
from hs_capture.offline.verify.values import as_array, identical_pairs, value_problems

Progress = Callable[[int, int], None]
_HEADER_ERRORS = (fmt.HeaderTooSmall, fmt.BadMagic, fmt.HeaderTooLarge, fmt.InvalidHeader,
                  fmt.UnsupportedVersion, fmt.TensorInvalidInfo)


@dataclass
class _Step:
    run: Run
    rank: str
    line: dict
    damaged: bool = False  # a file of it is missing or unreadable: merge cannot cut samples from it

    @property
    def key(self) -> Tuple[str, str, int]:
        return (os.path.basename(self.run.path), self.rank, self.line["step"])


def _config(meta: dict) -> Tuple:
    return (tuple(meta.get("layers") or ()), meta.get("hidden_size"), meta.get("num_layers"),
            bool(meta.get("prenorm", False)), meta.get("model_path"), meta.get("layer_convention"))


def _config_text(key: Tuple) -> str:
    return f"layers={list(key[0])} hidden={key[1]} num_layers={key[2]} prenorm={key[3]} model={key[4]}"


def _parts(meta: dict) -> Set[str]:
    return set(step_parts(meta["layers"], bool(meta.get("prenorm"))))


def _rel(run: Run, path: str) -> str:
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
    dp_size = max(int((m.get("parallel") or {}).get("dp_size", 1) or 1) for m in run.ranks.values())
    present = {int((m.get("parallel") or {}).get("dp_rank", 0) or 0) for m in run.ranks.values()}
    for dp in sorted(set(range(dp_size)) - present):
        report.add("ranks", f"DP group {dp} of {dp_size} wrote no rank metadata: that rank's files are missing",
                   path=run.path)


def check_index(run: Run, report: Report) -> List[_Step]:
    """Per rank: its index lines, then its metadata's account of them; then the files on disk
    against what the index lists. Returns the steps that hold files."""
    # A run that never closed (killed, or still running) leaves debris that is not damage:
    # temp files, files whose index line was never appended, gaps where a later step was
    # indexed first. Those are warnings; what they cost is judged per sample (coverage).
    clean = all(m.get("status") == "closed" and not m.get("capture_stopped") for m in run.ranks.values())
    debris = ERROR if clean else WARNING
    why = "" if clean else " (the run did not close cleanly: debris of a crash or a full disk, or it is still running)"
    steps: List[_Step] = []
    for tag, meta in sorted(run.ranks.items()):
        written = _check_rank_index(run, tag, meta, report, steps, debris, why)
        _check_rank_meta(run, tag, meta, written, report)
    if run.ranks and not steps:
        report.add("runs", "the run captured nothing (no written step in any rank)", path=run.path)
    listed = {os.path.normpath(f["path"]) for st in steps for f in st.line["files"].values()}
    missing = _check_files(run, listed, report, debris, why)
    for st in steps:
        if any(os.path.normpath(f["path"]) in missing for f in st.line["files"].values()):
            st.damaged = True
    return steps


def _check_rank_index(run: Run, tag: str, meta: dict, report: Report, steps: List[_Step], debris: str,
                      why: str) -> int:
    """One rank's index lines: malformed, doubled, dropped and missing steps; the written ones
    go to `steps`. Returns how many steps the index says were written."""
    ipath = _rel(run, run.index_path(tag))
    if not os.path.exists(run.index_path(tag)):
        report.add("index", "index file missing", path=ipath)
        return 0
    seen: Dict[int, int] = {}
    written = 0
    want = _parts(meta)
    for n, line, problem in run.index_entries(tag):
        if problem == TORN:
            report.add("index", TORN, WARNING, ipath)
            continue
        report.looked("index")
        if problem:
            report.add("index", f"line {n}: {problem}", path=ipath)
            continue
        step = line["step"]
        if step in seen:
            report.add("index", f"line {n}: step {step} listed twice (first on line {seen[step]})", path=ipath)
            continue
        seen[step] = n
        if "dropped" in line:
            rids = sorted({str(s.get("rid")) for s in line.get("seqs", [])})
            report.add("dropped", f"step {step} dropped by the writer ({line['dropped']}): "
                                  f"{line.get('num_tokens', '?')} tokens of rids {rids[:5]}"
                                  f"{' ...' if len(rids) > 5 else ''} were not written", path=ipath)
            continue
        written += 1
        if set(line["files"]) != want:
            report.add("shapes", f"step {step}: parts {sorted(line['files'])} differ from the run's {sorted(want)}",
                       path=ipath)
        steps.append(_Step(run, tag, line))
    missing = sorted(set(range(max(seen) + 1)) - set(seen)) if seen else []
    if missing:
        report.add("index", f"{len(missing)} step(s) have no index line: {_ranges(missing)} "
                            "(lost in a crash, or the line was removed)" + why, debris, ipath)
    return written


def _check_rank_meta(run: Run, tag: str, meta: dict, written: int, report: Report) -> None:
    """One rank's metadata: a capture stop, failed steps, its status and its step count."""
    mpath = _rel(run, os.path.join(run.path, "ranks", tag + ".json"))
    report.looked("dropped")
    stats = meta.get("stats") or {}
    stopped = meta.get("capture_stopped")
    if isinstance(stopped, dict):
        report.add("dropped", f"capture stopped at step {stopped.get('step')} "
                              f"({time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(stopped.get('time') or 0))} UTC): "
                              f"{stopped.get('reason')}; later prefills were not written", path=mpath)
    if stats.get("steps_failed"):
        report.add("dropped", f"the writer failed {stats['steps_failed']} step(s): {meta.get('last_failure')}",
                   path=mpath)
    report.looked("status")
    if meta.get("status") != "closed":
        report.add("status", f"run status is {meta.get('status')!r}, not 'closed': the server is still "
                             "running, or was killed (its last queued steps may be missing)", WARNING, mpath)
    elif stats.get("steps_written") is not None and int(stats["steps_written"]) != written:
        report.add("index", f"the metadata counts {stats['steps_written']} written steps, the index "
                            f"lists {written}", path=_rel(run, run.index_path(tag)))


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
            rel = os.path.relpath(full, run.path)
            if TEMP_MARK in name:
                report.add("files", "temp file left by an interrupted write" + why, debris, _rel(run, full))
            elif rel.startswith("data" + os.sep) and name.endswith(TENSOR_SUFFIX):
                on_disk.add(os.path.normpath(rel))
    report.looked("files", len(listed | on_disk))
    for rel in sorted(listed - on_disk):
        report.add("files", "missing: the index lists it, the disk does not have it",
                   path=_rel(run, os.path.join(run.path, rel)))
    for rel in sorted(on_disk - listed):
        report.add("files", "extra: on disk but in no index line (its index line is missing?)" + why, debris,
                   _rel(run, os.path.join(run.path, rel)))
    return listed - on_disk


class _Marking:
    """A Report view that marks the step damaged when a structural error is added for it."""

    STRUCTURAL = {"files", "header", "truncated", "checksum", "placement", "shapes", "positions"}

    def __init__(self, report: Report, step: _Step) -> None:
        self._report, self._step = report, step

    def add(self, check: str, message: str, severity: str = "error", path: Optional[str] = None,
            rid: Optional[str] = None) -> None:
        if severity == "error" and check in self.STRUCTURAL:
            self._step.damaged = True
        self._report.add(check, message, severity, path, rid)

    def looked(self, check: str, n: int = 1) -> None:
        self._report.looked(check, n)


def check_step(step: _Step, report: Report, dataset: Optional[Dict[str, List[int]]]) -> int:
    """Decode every file of one step and check it. Returns bytes read."""
    line = step.line
    report = _Marking(report, step)
    hidden: Dict[str, np.ndarray] = {}
    crcs: Dict[str, int] = {}
    final: Dict[str, np.ndarray] = {}
    read = 0
    for part, f in sorted(line["files"].items()):
        got = _check_part(step, part, f, report)
        if got is None:
            continue
        read += got.size
        if "hidden" in got.arrays:
            hidden[part], crcs[part] = got.arrays["hidden"], got.hidden_crc
            report.looked("nonfinite")
            report.looked("degenerate")
            for check, msg in value_problems(got.arrays["hidden"], got.hidden_bf16):
                report.add(check, msg, path=got.rel)
        if part == FINAL:
            final = got.arrays
    report.looked("identical")
    for a, b in identical_pairs(hidden, crcs):
        report.add("identical", f"parts {a} and {b} hold bit-identical states (the same layer written twice?)",
                   path=_rel(step.run, os.path.join(step.run.path, line["files"][b]["path"])))
    if "positions" in final and "input_ids" in final:
        _check_rows(step, final, dataset, report)
    return read


@dataclass
class _Decoded:
    """One part file of a step, decoded: what check_step needs to compare the parts."""
    rel: str
    size: int
    arrays: Dict[str, np.ndarray]
    hidden_crc: int = 0
    hidden_bf16: bool = False


def _check_part(step: _Step, part: str, f: dict, report: "_Marking") -> Optional[_Decoded]:
    """Open, parse and decode one part file, reporting what is wrong with its structure.
    None when it cannot be read at all (the finding is reported)."""
    path = os.path.join(step.run.path, f["path"])
    rel = _rel(step.run, path)
    report.looked("header")
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            header = _read_header(fh, size, f, rel, report)
            if header is None:
                return _Decoded(rel, size, {})
            report.looked("truncated")
            if isinstance(f.get("bytes"), int) and f["bytes"] != size:  # whole, but not what was indexed
                report.add("files", f"file has {size} bytes, the index recorded {f['bytes']} "
                                    "(rewritten after capture?)", WARNING, rel)
            meta = step.run.ranks[step.rank]
            _check_placement(header.metadata, meta.get("run_id"), step.rank, step.line["step"], part, rel, report)
            names = {"hidden", "input_ids", "positions"} if part == FINAL else {"hidden"}
            if set(header.tensors) != names:
                report.add("shapes", f"holds tensors {sorted(header.tensors)}, expected {sorted(names)}", path=rel)
            out = _Decoded(rel, size, {})
            for name, e in header.tensors.items():
                report.looked("checksum")
                try:
                    raw = fmt.read_tensor_bytes(fh, header, name)
                except fmt.FormatError as err:
                    report.add("checksum", f"{name}: {err}", path=rel)
                    continue
                out.arrays[name] = as_array(raw, e.dtype, e.shape)
                if name == "hidden":
                    out.hidden_crc, out.hidden_bf16 = e.crc32, e.dtype == "bfloat16"
                _check_shape(name, e, step.line["num_tokens"], meta["hidden_size"], step.line.get("dtype"), rel,
                             report)
            return out
    except OSError as e:
        if not isinstance(e, FileNotFoundError):  # a missing file is the files check's
            report.add("files", f"unreadable: {e.strerror or e}", path=rel)
        return None


def _read_header(fh, size: int, f: dict, rel: str, report: "_Marking") -> Optional[fmt.Header]:
    """The file's header, or None with the finding reported under the check it belongs to."""
    try:
        return fmt.read_header(fh, size)
    except fmt.Truncated as e:
        report.add("truncated", str(e), path=rel)
    except (fmt.InvalidOffset, fmt.TrailingBytes) as e:
        # shorter than the index says it was written: cut, whatever the header then claims
        short = isinstance(f.get("bytes"), int) and size < f["bytes"]
        report.add("truncated" if short else "header", f"{type(e).__name__}: {e}", path=rel)
    except _HEADER_ERRORS as e:
        report.add("header", f"{type(e).__name__}: {e}", path=rel)
    except fmt.CodecError as e:
        report.add("header", str(e), path=rel)
    return None


def _check_placement(md: Dict[str, str], run_id: Optional[str], rank: str, step: int, part: str, rel: str,
                     report: Report) -> None:
    report.looked("placement")
    want = {"run_id": run_id, "rank": rank, "step": str(step), "part": part}
    wrong = [f"{k}={md.get(k)!r} (expected {v!r})" for k, v in want.items() if v is not None and md.get(k) != v]
    if wrong:
        report.add("placement", "the file holds another place's data: " + ", ".join(wrong), path=rel)


def _check_shape(name: str, e: fmt.TensorEntry, n: int, hidden_size: int, dtype: Optional[str], rel: str,
                 report: Report) -> None:
    report.looked("shapes")
    if name == "hidden":
        want_shape, ok_dtype = (n, hidden_size), (dtype is None or e.dtype == dtype)
    else:
        want_shape, ok_dtype = (n,), e.dtype in ("int64", "int32")
    if tuple(e.shape) != want_shape:
        report.add("shapes", f"{name} has shape {list(e.shape)}, the index and run need {list(want_shape)}", path=rel)
    if not ok_dtype:
        report.add("shapes", f"{name} is {e.dtype}, the index says {dtype}", path=rel)


def _check_rows(step: _Step, final: Dict[str, np.ndarray], dataset: Optional[Dict[str, List[int]]],
                report: Report) -> None:
    rel = _rel(step.run, os.path.join(step.run.path, step.line["files"][FINAL]["path"]))
    pos, ids = final["positions"], final["input_ids"]
    for s in step.line["seqs"]:
        a, ln, pre = s["offset"], s["len"], s["prefix"]
        report.looked("positions")
        got = pos[a:a + ln]
        if len(got) != ln or not np.array_equal(got, np.arange(pre, pre + ln)):
            report.add("positions", f"step {step.line['step']}: stored positions are not {pre}..{pre + ln - 1} "
                                    "as the index says", path=rel, rid=s["rid"])
        if dataset is not None and s["rid"] in dataset:
            report.looked("tokens")
            want = dataset[s["rid"]][pre:pre + ln]
            have = ids[a:a + ln].tolist()
            k = first_mismatch(have, want)
            if k is not None:
                report.add("tokens", f"token at position {pre + k} is {have[k] if k < len(have) else None}, "
                                     f"the dataset has {want[k] if k < len(want) else None}", path=rel, rid=s["rid"])


def check_coverage(paths: Sequence[str], runs: List[Run], steps: List[_Step], report: Report,
                   lengths: Optional[Dict[str, int]]) -> Optional[Plan]:
    """Which samples are whole, by the rule merge and send use (coverage.whole_chain); pieces
    captured again (a retry, a re-send, another rank) are warnings. Returns merge's plan of the
    samples (None when the runs cannot be planned together)."""
    try:
        p = plan(paths, lengths, strict=False)
    except MixedRuns:
        return None  # reported by the config check; coverage over a mix means nothing
    except DumpError as e:
        report.add("coverage", f"cannot plan the samples: {e}")
        return None
    report.looked("coverage", len(p.samples) + len(p.incomplete))
    for rid, reason in sorted(p.incomplete.items()):
        report.add("coverage", reason, rid=rid)
    damaged = {st.key for st in steps if st.damaged}
    lost = 0
    for rid, pieces in sorted(p.samples.items()):
        bad = [pc for pc in pieces if (os.path.basename(p.runs[pc.run].path), pc.rank, pc.step) in damaged]
        if bad:
            lost += 1
            report.add("coverage", f"step {bad[0].step} of {bad[0].rank} is damaged (see the file findings): "
                                   "merge cannot assemble this sample", rid=rid)
    for rid, extra in sorted(p.extras.items()):
        if rid in p.samples:
            for pc in extra[:3]:
                where = f"step {pc.step} of {pc.rank}, {os.path.basename(p.runs[pc.run].path)}"
                report.add("coverage", describe_extra(Span(pc.prefix, pc.prefix + pc.length), where), WARNING,
                           rid=rid)
    report.stats.update(samples_complete=len(p.samples) - lost, samples_incomplete=len(p.incomplete) + lost,
                        tokens=sum(pc.length for pcs in p.samples.values() for pc in pcs))
    return p


# ------------------------------------------------------------- the step pass, in processes
_DATASET: Dict[str, Optional[Dict[str, List[int]]]] = {}  # a worker's copy, sent once


def _init_worker(dataset: Optional[Dict[str, List[int]]]) -> None:
    keep_large_buffers()  # each step's buffers reuse the heap (heap.py)
    _DATASET["ids"] = dataset


def _check_alone(step: _Step) -> Tuple[List[Finding], Dict[str, int], bool, int, int]:
    """check_step in a worker process: its own report, sent back whole with the damage mark
    and the worker's peak memory."""
    mine = Report([])
    read = check_step(step, mine, _DATASET.get("ids"))
    return mine.findings, mine.ran, step.damaged, read, peak_rss_bytes()


def _check_steps(todo: List[_Step], report: Report, dataset: Optional[Dict[str, List[int]]], jobs: int,
                 progress: Optional[Progress]) -> int:
    """Decode and check every step of `todo` (in `jobs` processes when there is more than one
    step); returns the bytes read."""
    if jobs <= 1 or len(todo) <= 1:
        _init_worker(dataset)
        try:
            results = map(_check_alone, todo)
            return _collect(todo, results, report, progress)
        finally:
            _DATASET.clear()
    results = process_map(_check_alone, todo, jobs, [__name__], _init_worker, (dataset,))
    return _collect(todo, results, report, progress)


def _collect(todo: List[_Step], results, report: Report, progress: Optional[Progress]) -> int:
    read = 0
    for k, (step, (findings, ran, damaged, n, peak)) in enumerate(zip(todo, results), 1):
        report.stats["worker_peak_rss_mb"] = max(report.stats.get("worker_peak_rss_mb", 0), peak >> 20)
        report.findings.extend(findings)
        for check, count in ran.items():
            report.looked(check, count)
        step.damaged = step.damaged or damaged
        read += n
        if progress:
            progress(k, len(todo))
    return read


def verify_dump(paths: Sequence[str], report: Report, dataset: Optional[Dict[str, List[int]]] = None,
                sample: Optional[int] = None, jobs: int = 4, seed: int = 0,
                progress: Optional[Progress] = None) -> Optional[Plan]:
    """Every dump check; returns the samples' plan (for --reference) when there is one."""
    runs = check_runs(paths, report)
    steps: List[_Step] = []
    for run in runs:
        steps += check_index(run, report)
    todo = pick(steps, sample, seed)
    report.stats.update(runs=len(runs), ranks=sum(len(r.ranks) for r in runs), steps=len(steps),
                        steps_decoded=len(todo))
    report.stats["bytes_read"] = _check_steps(todo, report, dataset, jobs, progress)
    return check_coverage(paths, runs, steps, report,
                          {k: len(v) for k, v in dataset.items()} if dataset is not None else None)
