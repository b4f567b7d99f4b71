"""Verify each step's files by decoding them: header, length, checksum, placement (the file
holds the run, rank, step and part its name says), shapes and dtypes against the index and
the run, stored positions and (with a dataset) token ids, and the values (NaN/Inf, all-zero or
constant, bit-identical parts). Steps are checked in worker processes; a structural finding
marks the step damaged, so the sample check knows which samples merge cannot assemble."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from hs_capture.dump import hst as fmt
from hs_capture.dump.paths import FINAL
from hs_capture.dump.schema import FileRef
from hs_capture.offline.workers.heap import keep_large_buffers
from hs_capture.offline.workers.procs import peak_rss_bytes
from hs_capture.offline.read.reader import first_mismatch
from hs_capture.offline.verify.index import Step
from hs_capture.offline.verify.pool import process_map
from hs_capture.offline.verify.report import WARNING, Finding, Report
from hs_capture.offline.verify.runs import rel
from hs_capture.offline.verify.values import as_array, identical_pairs, value_problems
from hs_capture.dump.quant import SCALE_TENSOR

Progress = Callable[[int, int], None]
_HEADER_ERRORS = (fmt.HeaderTooSmall, fmt.BadMagic, fmt.HeaderTooLarge, fmt.InvalidHeader,
                  fmt.UnsupportedVersion, fmt.TensorInvalidInfo)


class _Marking:
    """A Report view that marks the step damaged when a structural error is added for it."""

    STRUCTURAL = {"files", "header", "truncated", "checksum", "placement", "shapes", "positions"}

    def __init__(self, report: Report, step: Step) -> None:
        self._report, self._step = report, step

    def add(self, check: str, message: str, severity: str = "error", path: Optional[str] = None,
            rid: Optional[str] = None) -> None:
        if severity == "error" and check in self.STRUCTURAL:
            self._step.damaged = True
        self._report.add(check, message, severity, path, rid)

    def looked(self, check: str, n: int = 1) -> None:
        self._report.looked(check, n)


def check_step(step: Step, report: Report, dataset: Optional[Dict[str, List[int]]]) -> int:
    """Decode every file of one step and check it. Returns bytes read."""
    line = step.line
    report = _Marking(report, step)
    hidden: Dict[str, np.ndarray] = {}
    crcs: Dict[str, int] = {}
    final: Dict[str, np.ndarray] = {}
    read = 0
    for part, f in sorted(line.files.items()):
        got = _check_part(step, part, f, report)
        if got is None:
            continue
        read += got.size
        if "hidden" in got.arrays:
            hidden[part], crcs[part] = got.arrays["hidden"], got.hidden_crc
            report.looked("nonfinite")
            report.looked("degenerate")
            for check, msg in value_problems(got.arrays["hidden"], got.hidden_dtype == "bfloat16",
                                             got.hidden_dtype == "float8_e4m3fn"):
                report.add(check, msg, path=got.rel)
            scale = got.arrays.get(SCALE_TENSOR)
            if scale is not None and not np.isfinite(scale).all():
                report.add("nonfinite", f"{SCALE_TENSOR}: {int((~np.isfinite(scale)).sum())} scales are not finite",
                           path=got.rel)
        if part == FINAL:
            final = got.arrays
    report.looked("identical")
    for a, b in identical_pairs(hidden, crcs):
        report.add("identical", f"parts {a} and {b} hold bit-identical states (the same layer written twice?)",
                   path=rel(step.run, os.path.join(step.run.path, line.files[b].path)))
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
    hidden_dtype: str = ""


def _check_part(step: Step, part: str, f: FileRef, report: _Marking) -> Optional[_Decoded]:
    """Open, parse and decode one part file, reporting what is wrong with its structure.
    None when it cannot be read at all (the finding is reported)."""
    path = os.path.join(step.run.path, f.path)
    where = rel(step.run, path)
    report.looked("header")
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            header = _read_header(fh, size, f, where, report)
            if header is None:
                return _Decoded(where, size, {})
            report.looked("truncated")
            if f.bytes and f.bytes != size:  # whole, but not what was indexed
                report.add("files", f"file has {size} bytes, the index recorded {f.bytes} "
                                    "(rewritten after capture?)", WARNING, where)
            meta = step.run.ranks[step.rank]
            _check_placement(header.metadata, meta.run_id or None, step.rank, step.line.step, part, where, report)
            names = {"hidden", "input_ids", "positions"} if part == FINAL else {"hidden"}
            if "hidden" in header.tensors and header.tensors["hidden"].scale:  # the compact tier
                names.add(SCALE_TENSOR)
            if set(header.tensors) != names:
                report.add("shapes", f"holds tensors {sorted(header.tensors)}, expected {sorted(names)}", path=where)
            out = _Decoded(where, size, {})
            for name, e in header.tensors.items():
                report.looked("checksum")
                try:
                    raw = fmt.read_tensor_bytes(fh, header, name)
                except fmt.FormatError as err:  # its message names the tensor
                    report.add("checksum", str(err) if str(err).startswith(f"{name}:") else f"{name}: {err}",
                               path=where)
                    continue
                out.arrays[name] = as_array(raw, e.dtype, e.shape)
                if name == "hidden":
                    out.hidden_crc, out.hidden_dtype = e.crc32, e.dtype
                _check_shape(name, e, step.line.num_tokens, meta.hidden_size, step.line.dtype or None, where,
                             report)
            return out
    except OSError as e:
        if not isinstance(e, FileNotFoundError):  # a missing file is the files check's
            report.add("files", f"unreadable: {e.strerror or e}", path=where)
        return None


def _read_header(fh, size: int, f: FileRef, where: str, report: _Marking) -> Optional[fmt.Header]:
    """The file's header, or None with the finding reported under the check it belongs to."""
    try:
        return fmt.read_header(fh, size)
    except fmt.Truncated as e:
        report.add("truncated", str(e), path=where)
    except (fmt.InvalidOffset, fmt.TrailingBytes) as e:
        # shorter than the index says it was written: cut, whatever the header then claims
        short = bool(f.bytes) and size < f.bytes
        report.add("truncated" if short else "header", f"{type(e).__name__}: {e}", path=where)
    except _HEADER_ERRORS as e:
        report.add("header", f"{type(e).__name__}: {e}", path=where)
    except fmt.CodecError as e:
        report.add("header", str(e), path=where)
    return None


def _check_placement(md: Dict[str, str], run_id: Optional[str], rank: str, step: int, part: str, where: str,
                     report: _Marking) -> None:
    report.looked("placement")
    want = {"run_id": run_id, "rank": rank, "step": str(step), "part": part}
    wrong = [f"{k}={md.get(k)!r} (expected {v!r})" for k, v in want.items() if v is not None and md.get(k) != v]
    if wrong:
        report.add("placement", "the file holds another place's data: " + ", ".join(wrong), path=where)


def _check_shape(name: str, e: fmt.TensorEntry, n: int, hidden_size: int, dtype: Optional[str], where: str,
                 report: _Marking) -> None:
    report.looked("shapes")
    if name == "hidden":
        want_shape, ok_dtype = (n, hidden_size), (dtype is None or e.dtype == dtype)
    elif name == SCALE_TENSOR:
        want_shape, ok_dtype = (n,), e.dtype == "float32"
    else:
        want_shape, ok_dtype = (n,), e.dtype in ("int64", "int32")
    if tuple(e.shape) != want_shape:
        report.add("shapes", f"{name} has shape {list(e.shape)}, the index and run need {list(want_shape)}",
                   path=where)
    if not ok_dtype:
        report.add("shapes", f"{name} is {e.dtype}, the index says {dtype}", path=where)


def _check_rows(step: Step, final: Dict[str, np.ndarray], dataset: Optional[Dict[str, List[int]]],
                report: _Marking) -> None:
    where = rel(step.run, os.path.join(step.run.path, step.line.files[FINAL].path))
    pos, ids = final["positions"], final["input_ids"]
    for s in step.line.seqs:
        a, ln, pre = s.offset, s.len, s.prefix
        report.looked("positions")
        got = pos[a:a + ln]
        if len(got) != ln or not np.array_equal(got, np.arange(pre, pre + ln)):
            report.add("positions", f"step {step.line.step}: stored positions are not {pre}..{pre + ln - 1} "
                                    "as the index says", path=where, rid=s.rid)
        if dataset is not None and s.rid in dataset:
            report.looked("tokens")
            want = dataset[s.rid][pre:pre + ln]
            have = ids[a:a + ln].tolist()
            k = first_mismatch(have, want)
            if k is not None:
                report.add("tokens", f"token at position {pre + k} is {have[k] if k < len(have) else None}, "
                                     f"the dataset has {want[k] if k < len(want) else None}", path=where, rid=s.rid)


# ------------------------------------------------------------- in worker processes
_DATASET: Dict[str, Optional[Dict[str, List[int]]]] = {}  # a worker's copy, sent once


def _init_worker(dataset: Optional[Dict[str, List[int]]]) -> None:
    keep_large_buffers()  # each step's buffers reuse the heap (heap.py)
    _DATASET["ids"] = dataset


def _check_alone(step: Step) -> Tuple[List[Finding], Dict[str, int], bool, int, int]:
    """check_step in a worker process: its own report, sent back whole with the damage mark
    and the worker's peak memory."""
    mine = Report([])
    read = check_step(step, mine, _DATASET.get("ids"))
    return mine.findings, mine.ran, step.damaged, read, peak_rss_bytes()


def check_steps(todo: List[Step], report: Report, dataset: Optional[Dict[str, List[int]]], jobs: int,
                progress: Optional[Progress]) -> int:
    """Decode and check every step of `todo` (in `jobs` processes when there is more than one
    step); returns the bytes read."""
    if jobs <= 1 or len(todo) <= 1:
        _init_worker(dataset)
        try:
            return _collect(todo, map(_check_alone, todo), report, progress)
        finally:
            _DATASET.clear()
    results = process_map(_check_alone, todo, jobs, [__name__], _init_worker, (dataset,))
    return _collect(todo, results, report, progress)


def _collect(todo: List[Step], results, report: Report, progress: Optional[Progress]) -> int:
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
