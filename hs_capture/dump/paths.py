"""Where things live in a dump directory (shared by the server side and the offline tools).

    HSCAP_DIR/<run_id>/
        ranks/<rank>.json                      run metadata, one per writing rank
        index/<rank>.jsonl                     one line per forward step, appended after its files are durable
        data/<rank>/<step // 1000>/<rank>.s<step>.<part>.hst
                                               part: L<layer> (a captured layer), final (the
                                               post-norm state, with input_ids and positions),
                                               prenorm (the final norm's input, if asked for)

<rank> is "dp<d>-tp<t>-pp<p>". Nothing a client sends (the rid) ever becomes part of a path:
rids live only inside index lines.
"""

from __future__ import annotations

import os
import re
import socket
import time
from dataclasses import dataclass

TENSOR_SUFFIX = ".hst"
# What `hscap merge` writes beside the samples (merge writes them, verify and the dataset read them).
MERGE_REPORT = "merge_report.json"
NATIVE_INDEX = "index.json"  # the native format's sample index
TEMP_MARK = ".tmp-"
STEPS_PER_DIR = 1000
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class RankId:
    dp: int = 0
    tp: int = 0
    pp: int = 0

    @property
    def tag(self) -> str:
        return f"dp{self.dp}-tp{self.tp}-pp{self.pp}"


def safe_component(text: str, limit: int = 64) -> str:
    """A string reduced to a harmless single path component."""
    cleaned = _SAFE.sub("_", text).strip("._") or "x"
    return cleaned[:limit]


def new_run_id(now: float | None = None) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now if now is not None else time.time()))
    return f"run-{stamp}-{safe_component(socket.gethostname(), 32)}-{os.getpid()}"


FINAL = "final"
PRENORM = "prenorm"


def part_name(layer: int) -> str:
    """The part (file) name of a captured layer: L02, L30, ..."""
    return f"L{layer:02d}"


def step_parts(layers, prenorm: bool) -> list:
    """Every part one step of a run with these settings writes."""
    return [part_name(k) for k in layers] + [FINAL] + ([PRENORM] if prenorm else [])


def part_layer(part: str) -> "int | None":
    """The layer a part name holds, or None for final/prenorm."""
    return int(part[1:]) if part.startswith("L") and part[1:].isdigit() else None


def holds_dump(path: str) -> bool:
    """Whether `path` is a run dir or a dump dir holding one (a run dir has ranks/)."""
    try:
        return os.path.isdir(os.path.join(path, "ranks")) or any(
            os.path.isdir(os.path.join(path, d, "ranks")) for d in os.listdir(path))
    except OSError:
        return False


def rank_meta_path(run_dir: str, rank: RankId) -> str:
    return os.path.join(run_dir, "ranks", rank.tag + ".json")


def index_path(run_dir: str, rank: RankId) -> str:
    return os.path.join(run_dir, "index", rank.tag + ".jsonl")


def step_file(rank: RankId, step: int, part: str) -> str:
    """Path of one step's tensor file, relative to the run dir."""
    return os.path.join(
        "data", rank.tag, f"{step // STEPS_PER_DIR:06d}", f"{rank.tag}.s{step:09d}.{part}{TENSOR_SUFFIX}"
    )


def temp_name(path: str) -> str:
    """Hidden sibling name a file is written under before its atomic rename."""
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}{TEMP_MARK}{os.getpid()}")
