"""The dump's records, typed and versioned: one writing rank's run metadata
(`ranks/<rank>.json`), its index lines (`index/<rank>.jsonl`, one per forward step) and their
sequence entries. The one place that writes and reads them: the server builds these records
and writes `to_json()`; the offline tools read through `from_json()`. A record of a newer
schema than this code knows, a malformed one, or a file path that leaves the run dir is a
SchemaError with the reason. FORMAT.md documents every field (a test holds the two together).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Dict, List, Mapping, Optional, Tuple

from hs_capture.dump.hst import is_count
from hs_capture.dump.paths import inside

# "schema" in the run metadata; its index lines follow the same version. Dumps written before
# the field existed are version 1.
SCHEMA_VERSION = 2  # the newest this code reads
# what a run is written as: 2 only for the compact tier (fp8 states, which an older reader
# could not read), so a lossless dump stays readable by every release
SCHEMA_LOSSLESS, SCHEMA_COMPACT = 1, 2
LAYER_CONVENTION = "entering: index i = residual stream entering decoder layer i = transformers hidden_states[i]"


class SchemaError(ValueError):
    """A record that is not one this code can read: the message says why."""


# ----------------------------------------------------------------- index lines
@dataclass(frozen=True)
class SeqEntry:
    """One request's rows in a step: rows offset..offset+len, positions prefix..prefix+len.
    A request's first piece may borrow positions [0, prefix) from another captured request
    (`src`), whose token ids there have the digest `src_hash` (dump/token_hash.prefix_hash)."""
    rid: Optional[str]
    len: int
    prefix: int
    offset: int
    src: Optional[str] = None
    src_hash: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        out = {"rid": self.rid, "len": self.len, "prefix": self.prefix, "offset": self.offset}
        if self.src is not None:
            out.update(src=self.src, src_hash=self.src_hash)
        return out


@dataclass(frozen=True)
class FileRef:
    """One part's file of a step, relative to the run dir, and its size."""
    path: str
    bytes: int


@dataclass(frozen=True)
class IndexLine:
    """One forward step of one rank. Written steps list their files; a dropped step names why."""
    step: int
    mode: str = ""
    num_tokens: int = 0
    rows: int = 0
    dtype: str = ""
    seqs: Tuple[SeqEntry, ...] = ()
    files: Optional[Mapping[str, FileRef]] = None
    dropped: Optional[str] = None
    time: Optional[float] = None

    @property
    def written(self) -> bool:
        return self.files is not None

    def rids(self) -> List[Optional[str]]:
        return [s.rid for s in self.seqs]

    def committed(self, step: int, files: Mapping[str, FileRef], when: float) -> "IndexLine":
        """This step's line once its files are durable."""
        return replace(self, step=step, files=dict(files), time=when)

    def dropped_as(self, step: int, why: str, when: float) -> "IndexLine":
        return replace(self, step=step, dropped=why, time=when)

    def to_json(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"mode": self.mode, "num_tokens": self.num_tokens, "rows": self.rows,
                               "dtype": self.dtype, "seqs": [s.to_json() for s in self.seqs], "step": self.step}
        if self.files is not None:
            out["files"] = {part: {"path": f.path, "bytes": f.bytes} for part, f in self.files.items()}
        if self.dropped is not None:
            out["dropped"] = self.dropped
        if self.time is not None:
            out["time"] = self.time
        return out

    @classmethod
    def from_json(cls, d: Any) -> "IndexLine":
        """The line, or SchemaError naming what is wrong with it. Paths must stay inside the run dir."""
        if not isinstance(d, dict):
            raise SchemaError("not a JSON object")
        if not is_count(d.get("step")):
            raise SchemaError("no valid step number")
        common = {"step": d["step"], "mode": str(d.get("mode") or ""), "dtype": str(d.get("dtype") or ""),
                  "time": d.get("time") if isinstance(d.get("time"), (int, float)) else None}
        if "files" not in d:
            if "dropped" not in d:
                raise SchemaError("neither files nor dropped")
            n = d.get("num_tokens")
            return cls(**common, num_tokens=n if is_count(n) else 0, rows=d.get("rows") if is_count(
                d.get("rows")) else 0, seqs=_seqs(d.get("seqs"), None), dropped=str(d["dropped"]))
        files, n = d.get("files"), d.get("num_tokens")
        if not isinstance(files, dict) or not isinstance(d.get("seqs"), list) or not is_count(n):
            raise SchemaError("files, seqs or num_tokens malformed")
        refs = {}
        for part, f in files.items():
            rel = f.get("path") if isinstance(f, dict) else None
            if not inside(rel):
                raise SchemaError(f"part {part!r} has no path inside the run dir")
            refs[str(part)] = FileRef(rel, int(f["bytes"]) if is_count(f.get("bytes")) else 0)
        rows = d.get("rows")
        return cls(**common, num_tokens=n, rows=rows if is_count(rows) else n, seqs=_seqs(d["seqs"], n),
                   files=refs)


def _seqs(raw: Any, num_tokens: Optional[int]) -> Tuple[SeqEntry, ...]:
    """Sequence entries; each must fit the step's rows when `num_tokens` is given."""
    if num_tokens is None and not isinstance(raw, list):
        return ()
    out = []
    for s in raw:
        if not isinstance(s, dict) or not all(is_count(s.get(k)) for k in ("len", "prefix", "offset")) \
                or not (s.get("rid") is None or isinstance(s.get("rid"), str)):
            raise SchemaError("a seq entry is malformed")
        if num_tokens is not None and s["offset"] + s["len"] > num_tokens:
            raise SchemaError("a seq runs past num_tokens")
        src, src_hash = s.get("src"), s.get("src_hash")
        if src is not None and not (isinstance(src, str) and isinstance(src_hash, str) and s["prefix"] > 0):
            raise SchemaError("a seq's borrowed prefix (src, src_hash) is malformed")
        out.append(SeqEntry(s.get("rid"), s["len"], s["prefix"], s["offset"], src, src_hash if src else None))
    return tuple(out)


def step_line(mode: str, num_tokens: int, rows: int, dtype: str, seqs: List[SeqEntry]) -> IndexLine:
    """What a forward knows of its step before the writer numbers and commits it."""
    return IndexLine(step=0, mode=mode, num_tokens=num_tokens, rows=rows, dtype=dtype, seqs=tuple(seqs))


# ----------------------------------------------------------------- run metadata
@dataclass
class RankMeta:
    """One writing rank's run metadata: what was captured and how (read by every offline tool),
    the writer's state and counters, and provenance kept as written (`extra`)."""
    layers: List[int]
    hidden_size: int
    num_layers: int = 0
    run_id: str = ""
    prenorm: bool = False
    final_state: str = "post_norm"
    layer_convention: str = LAYER_CONVENTION
    model_path: Optional[str] = None
    family: Optional[str] = None  # the target family: how a serving SGLang maps a drafter's layer ids
    architectures: List[str] = field(default_factory=list)
    served_architectures: List[str] = field(default_factory=list)
    sglang_version: Optional[str] = None
    hs_capture_version: Optional[str] = None
    parallel: Dict[str, Any] = field(default_factory=dict)  # tp/dp/pp sizes and this rank's place
    status: str = "running"  # running, closed, close_timed_out
    started: Optional[float] = None  # times (epoch seconds)
    closed: Optional[float] = None
    stats: Dict[str, Any] = field(default_factory=dict)  # the writer's counters
    capture_stopped: Optional[Dict[str, Any]] = None  # reason, step, time: capture stopped for good
    disk_bound: Optional[Dict[str, Any]] = None  # the rates when the disk held the forwards back
    last_failure: Optional[str] = None
    schema: int = SCHEMA_LOSSLESS
    extra: Dict[str, Any] = field(default_factory=dict)  # everything else (server flags, modes, host, ...)

    @property
    def closed_cleanly(self) -> bool:
        """Every queued step written and capture never stopped."""
        return self.status == "closed" and not self.capture_stopped

    @property
    def dp_rank(self) -> int:
        return int(self.parallel.get("dp_rank", 0) or 0)

    @property
    def dp_size(self) -> int:
        return int(self.parallel.get("dp_size", 1) or 1)

    def to_json(self) -> Dict[str, Any]:
        body = {k: v for k, v in asdict(self).items() if k != "extra"}
        return {**self.extra, **{k: v for k, v in body.items() if v is not None}}

    @classmethod
    def from_json(cls, d: Any) -> "RankMeta":
        if not isinstance(d, dict):
            raise SchemaError("not a run metadata object")
        version = d.get("schema", 1)
        if not is_count(version) or version > SCHEMA_VERSION:
            raise SchemaError(f"schema {version!r}: written by a newer hs_capture (this one reads schema "
                              f"<= {SCHEMA_VERSION}); upgrade hs_capture to read it")
        layers = d.get("layers")
        if not isinstance(layers, list) or not all(is_count(x) for x in layers):
            raise SchemaError("no valid layers list")
        if not is_count(d.get("hidden_size")) or not is_count(d.get("num_layers", 0)):
            raise SchemaError("no valid hidden_size or num_layers")
        known = {f.name for f in fields(cls)} - {"extra"}
        typed = {k: v for k, v in d.items() if k in known}
        for key, kind in (("parallel", dict), ("stats", dict), ("architectures", list),
                          ("served_architectures", list)):
            if not isinstance(typed.get(key, kind()), kind):
                raise SchemaError(f"{key} is not a {kind.__name__}")
        typed["run_id"] = str(d.get("run_id") or "")
        typed["prenorm"] = bool(d.get("prenorm", False))
        return cls(**typed, extra={k: v for k, v in d.items() if k not in known})
