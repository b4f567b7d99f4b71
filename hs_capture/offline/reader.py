"""Offline access to a dump: runs, their metadata, index lines and step tensors. Never
imports sglang. (Which pieces make a request whole: coverage.py, planning.py; stitching: assemble.py.)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from hs_capture.dump import hst as fmt
from hs_capture.dump.paths import TENSOR_SUFFIX


TORN = "torn last line (a crash while appending): that step is not committed"


class DumpError(Exception):
    """A dump that cannot be read as asked; the message names the file."""


def first_mismatch(got: List[int], want: List[int]) -> Optional[int]:
    """The first position where two token-id lists differ (the shorter length when one is a
    prefix of the other), or None when they are equal."""
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


@dataclass
class Run:
    path: str
    ranks: Dict[str, dict]  # rank tag -> run metadata

    @property
    def meta(self) -> dict:
        return next(iter(self.ranks.values()))

    @property
    def layers(self) -> List[int]:
        return list(self.meta["layers"])

    def index_path(self, rank: str) -> str:
        return os.path.join(self.path, "index", rank + ".jsonl")

    def index_entries(self, rank: str) -> Iterator[Tuple[int, Optional[dict], Optional[str]]]:
        """The one index reader: every line of one rank's index, in file order, as (line
        number, the line or None, why it is not a valid line or None). A torn last line (a crash
        while appending: its step is not committed) comes last, as (n, None, TORN)."""
        path = self.index_path(rank)
        if not os.path.exists(path):
            return
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                if not raw.endswith(b"\n"):
                    if raw.strip():
                        yield n, None, TORN
                    return
                try:
                    line = json.loads(raw)
                    problem = line_problem(line)
                except ValueError as e:
                    line, problem = None, f"not JSON ({e})"
                yield n, (None if problem else line), problem

    def index(self, rank: str, strict: bool = True) -> Iterator[dict]:
        """The valid index lines of one rank, in file order (a torn last line is not committed).
        A line that is not valid raises DumpError, or is skipped when not strict (verify
        reports such lines itself)."""
        for n, line, problem in self.index_entries(rank):
            if problem == TORN:
                return
            if problem:
                if strict:
                    raise DumpError(f"{self.index_path(rank)}: line {n} is not a valid index line ({problem})")
                continue
            yield line

    def read_part(self, line: dict, part: str) -> Dict[str, np.ndarray]:
        """All tensors of one step's part file ("final", "L03", ...) as numpy arrays."""
        rel = line["files"][part]["path"]
        path = os.path.join(self.path, rel)
        try:
            with open(path, "rb") as f:
                header = fmt.read_header(f, os.fstat(f.fileno()).st_size)
                return {name: fmt.to_numpy(fmt.read_tensor_bytes(f, header, name), e.dtype, e.shape)
                        for name, e in header.tensors.items()}
        except (OSError, fmt.FormatError) as e:
            raise DumpError(f"{rel}: {e}") from None


def _nonneg_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def line_problem(line) -> Optional[str]:
    """Why an index line is malformed, or None. Paths must stay inside the run dir."""
    if not isinstance(line, dict):
        return "not a JSON object"
    if not _nonneg_int(line.get("step")):
        return "no valid step number"
    if "files" not in line:
        return None if "dropped" in line else "neither files nor dropped"
    files, seqs = line.get("files"), line.get("seqs")
    if not isinstance(files, dict) or not isinstance(seqs, list) or not _nonneg_int(line.get("num_tokens")):
        return "files, seqs or num_tokens malformed"
    for part, f in files.items():
        rel = f.get("path") if isinstance(f, dict) else None
        if not isinstance(rel, str) or os.path.isabs(rel) or os.path.normpath(rel).startswith(".."):
            return f"part {part!r} has no path inside the run dir"
    for s in seqs:
        if not isinstance(s, dict) or not all(_nonneg_int(s.get(k)) for k in ("len", "prefix", "offset")) \
                or not (s.get("rid") is None or isinstance(s.get("rid"), str)):
            return "a seq entry is malformed"
        if s["offset"] + s["len"] > line["num_tokens"]:
            return "a seq runs past num_tokens"
    return None


def open_runs(dump_dir: str, errors: Optional[List[Tuple[str, str]]] = None) -> List[Run]:
    """Every run under a dump dir (or the run dir itself). An unreadable rank metadata file
    raises DumpError, or with `errors` given is appended there as (path, message) and skipped."""
    candidates = [dump_dir] + sorted(
        os.path.join(dump_dir, d) for d in os.listdir(dump_dir) if os.path.isdir(os.path.join(dump_dir, d))
    )
    runs = []
    for path in candidates:
        rdir = os.path.join(path, "ranks")
        if not os.path.isdir(rdir):
            continue
        ranks = {}
        for name in sorted(os.listdir(rdir)):
            if name.endswith(".json") and not name.startswith("."):
                mpath = os.path.join(rdir, name)
                try:
                    with open(mpath, "rb") as f:
                        meta = json.load(f)
                    if not isinstance(meta, dict) or not isinstance(meta.get("layers"), list):
                        raise ValueError("not a run metadata object")
                except (OSError, ValueError) as e:
                    if errors is None:
                        raise DumpError(f"{mpath}: unreadable run metadata ({e})") from None
                    errors.append((mpath, f"unreadable run metadata ({e})"))
                    continue
                ranks[name[:-5]] = meta
        if ranks:
            runs.append(Run(path, ranks))
    return runs


def tensor_files(run_path: str) -> Iterator[str]:
    for root, _, names in os.walk(os.path.join(run_path, "data")):
        for name in names:
            if name.endswith(TENSOR_SUFFIX):
                yield os.path.join(root, name)
