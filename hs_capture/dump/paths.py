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
from typing import List, Optional, Union

TENSOR_SUFFIX = ".hst"
# What `hscap merge` writes beside the samples (merge writes them, verify and the dataset read them).
MERGE_REPORT = "merge_report.json"
NATIVE_INDEX = "index.json"  # the native format's sample index
TEMP_MARK = ".tmp-"
STEPS_PER_DIR = 1000
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


RANKS, INDEX, DATA = "ranks", "index", "data"  # a run dir's subdirectories
_TAG = re.compile(r"dp(\d+)-tp(\d+)-pp(\d+)")


@dataclass(frozen=True)
class RankId:
    """A writing rank's place: its DP group, TP and PP ranks; named `dp<d>-tp<t>-pp<p>`."""
    dp: int = 0
    tp: int = 0
    pp: int = 0

    @property
    def tag(self) -> str:
        return f"dp{self.dp}-tp{self.tp}-pp{self.pp}"

    @classmethod
    def parse(cls, tag: str) -> Optional["RankId"]:
        """The rank a tag names, or None when it names none."""
        m = _TAG.fullmatch(tag)
        return cls(*(int(x) for x in m.groups())) if m else None


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


def inside(rel: object) -> bool:
    """A relative path that stays inside the directory it is relative to (what an index may
    name: a path read from a file never reaches outside its dump or output dir)."""
    return isinstance(rel, str) and bool(rel) and not os.path.isabs(rel) and not os.path.normpath(rel).startswith("..")


def is_run_dir(path: str) -> bool:
    return os.path.isdir(os.path.join(path, RANKS))


def holds_dump(path: str) -> bool:
    """Whether `path` is a run dir or a dump dir holding one."""
    try:
        return is_run_dir(path) or any(is_run_dir(os.path.join(path, d)) for d in os.listdir(path))
    except OSError:
        return False


def run_dirs(dump_dir: str) -> List[str]:
    """The run dirs of a dump dir (or the run dir itself), in name (= start time) order."""
    candidates = [dump_dir] + sorted(os.path.join(dump_dir, d) for d in os.listdir(dump_dir))
    return [p for p in candidates if is_run_dir(p)]


def rank_tags(run_dir: str) -> List[str]:
    """The ranks that wrote run metadata in a run dir (hidden files are claims and reserves)."""
    names = sorted(os.listdir(os.path.join(run_dir, RANKS)))
    return [n[: -len(".json")] for n in names if n.endswith(".json") and not n.startswith(".")]


def _tag(rank: Union[RankId, str]) -> str:
    return rank.tag if isinstance(rank, RankId) else rank


def rank_meta_path(run_dir: str, rank: Union[RankId, str]) -> str:
    return os.path.join(run_dir, RANKS, _tag(rank) + ".json")


def index_path(run_dir: str, rank: Union[RankId, str]) -> str:
    return os.path.join(run_dir, INDEX, _tag(rank) + ".jsonl")


def claim_path(run_dir: str, rank: RankId) -> str:
    """Created exclusively by the one process that writes this rank of this run."""
    return os.path.join(run_dir, RANKS, f".{rank.tag}.claimed")


def reserve_path(run_dir: str, rank: RankId) -> str:
    """Space held back so the run metadata can still record a full disk."""
    return os.path.join(run_dir, RANKS, f".{rank.tag}.reserve")


def rank_dirs(run_dir: str, rank: RankId) -> List[str]:
    """The directories one rank writes in."""
    return [os.path.join(run_dir, RANKS), os.path.join(run_dir, INDEX), os.path.join(run_dir, DATA, rank.tag)]


def step_file(rank: RankId, step: int, part: str) -> str:
    """Path of one step's tensor file, relative to the run dir."""
    return os.path.join(
        DATA, rank.tag, f"{step // STEPS_PER_DIR:06d}", f"{rank.tag}.s{step:09d}.{part}{TENSOR_SUFFIX}"
    )


def temp_name(path: str) -> str:
    """Hidden sibling name a file is written under before its atomic rename."""
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}{TEMP_MARK}{os.getpid()}")
