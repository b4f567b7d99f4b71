"""Offline access to a dump: runs, their metadata, index lines and step tensors. Never
imports sglang. (Which pieces make a request whole: coverage.py, planning.py; stitching: assemble.py.)
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from hs_capture.dump import hst as fmt
from hs_capture.dump.paths import index_path, rank_meta_path, rank_tags, run_dirs
from hs_capture.dump.schema import IndexLine, RankMeta, SchemaError


TORN = "torn last line (a crash while appending): that step is not committed"


class DumpError(Exception):
    """A dump that cannot be read as asked; the message names the file. One line also when a
    DataLoader worker raised it: torch re-raises it in the trainer's process as
    DumpError("Caught DumpError in DataLoader worker process N.\nOriginal Traceback ..."); the
    worker's own line is kept, and where it came from."""

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (_own_line(args[0]),)
        super().__init__(*args)


_WORKER = re.compile(r"Caught \w+ (in .+?)\.\nOriginal Traceback")


def _own_line(message: str) -> str:
    """A worker's re-raised message -> "its own line (in DataLoader worker process N)"."""
    m = _WORKER.match(message)
    lines = [x for x in message.splitlines() if x.strip()]
    if not m or not lines:
        return message
    return re.sub(r"^[\w.]+: ", "", lines[-1].strip(), count=1) + f" ({m.group(1)})"


def first_mismatch(got: List[int], want: List[int]) -> Optional[int]:
    """The first position where two token-id lists differ (the shorter length when one is a
    prefix of the other), or None when they are equal."""
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


@dataclass
class Run:
    path: str
    ranks: Dict[str, RankMeta]  # rank tag -> its run metadata

    @property
    def meta(self) -> RankMeta:
        return next(iter(self.ranks.values()))

    def index_path(self, rank: str) -> str:
        return index_path(self.path, rank)

    def index_entries(self, rank: str) -> Iterator[Tuple[int, Optional[IndexLine], Optional[str]]]:
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
                    yield n, IndexLine.from_json(json.loads(raw)), None
                except SchemaError as e:
                    yield n, None, str(e)
                except ValueError as e:
                    yield n, None, f"not JSON ({e})"

    def index(self, rank: str, strict: bool = True) -> Iterator[IndexLine]:
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

    def read_part(self, line: IndexLine, part: str) -> Dict[str, np.ndarray]:
        """All tensors of one step's part file ("final", "L03", ...) as numpy arrays."""
        rel = line.files[part].path
        try:
            return fmt.read_arrays(os.path.join(self.path, rel))
        except (OSError, fmt.FormatError) as e:
            raise DumpError(f"{rel}: {e}") from None


def open_runs(dump_dir: str, errors: Optional[List[Tuple[str, str]]] = None) -> List[Run]:
    """Every run under a dump dir (or the run dir itself). An unreadable rank metadata file
    (or one of a newer schema) raises DumpError, or with `errors` given is appended there as
    (path, message) and skipped."""
    runs = []
    for path in run_dirs(dump_dir):
        ranks = {}
        for tag in rank_tags(path):
            mpath = rank_meta_path(path, tag)
            try:
                with open(mpath, "rb") as f:
                    ranks[tag] = RankMeta.from_json(json.load(f))
            except (OSError, ValueError) as e:  # SchemaError is a ValueError
                if errors is None:
                    raise DumpError(f"{mpath}: unreadable run metadata ({e})") from None
                errors.append((mpath, f"unreadable run metadata ({e})"))
        if ranks:
            runs.append(Run(path, ranks))
    return runs
