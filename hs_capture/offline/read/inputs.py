"""The inputs: what a user sends and merges by (`--dataset`). Either
  - a JSONL file, one sample a line, {"id": ..., "input_ids": [...], "loss_mask": [...]}
    (loss_mask optional), parsed line by line, each problem named by its line number; or
  - speculators' prepared dataset (the directory `speculators prepare_data` saves with
    `datasets.save_to_disk`: input_ids, loss_mask, seq_len, already shuffled): row k is
    id "k", so merge --format speculators writes hs_k.safetensors where speculators reads it.
    Read with pyarrow (installed with speculators), imported only for such a directory.
A leaf: `hscap send` streams it (read_inputs), merge and verify load it whole for ids,
order and loss masks (load_inputs)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Set, Tuple


class BadLine(ValueError):
    """A dataset line that cannot be sent; the message names the line, `id` is the line's id
    when it could be read."""

    def __init__(self, message: str, sid: Optional[str] = None) -> None:
        super().__init__(message)
        self.id = sid


@dataclass(frozen=True)
class InputSample:
    line: int
    id: str
    input_ids: List[int]
    loss_mask: Optional[List[int]] = None


@dataclass
class Inputs:
    """The whole input file: per id, the token ids and loss mask, and the ids in file order."""

    ids: Dict[str, List[int]]
    masks: Dict[str, Optional[List[int]]]
    order: List[str]


def load_inputs(path: str) -> Inputs:
    """The whole input file; BadLine on its first bad line, OSError when it cannot be read."""
    out = Inputs({}, {}, [])
    for n, sample, error in read_inputs(path):
        if error is not None:
            raise BadLine(f"{path}: {error}", error.id)
        out.ids[sample.id] = sample.input_ids
        out.masks[sample.id] = sample.loss_mask
        out.order.append(sample.id)
    return out


def is_arrow_dataset(path: str) -> bool:
    """A `datasets.save_to_disk` directory (speculators' prepared data)."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, "state.json"))


def read_inputs(path: str) -> Iterator[Tuple[int, Optional[InputSample], Optional[BadLine]]]:
    """Yield (line number, sample or None, error or None) for every non-blank line (for a
    prepared dataset: every row, numbered from 1, its id the 0-based row)."""
    if is_arrow_dataset(path):
        yield from _read_arrow(path)
        return
    seen: Set[str] = set()
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                sample = parse_line(raw, n)
                if sample.id in seen:
                    raise BadLine(f"line {n}: duplicate id {sample.id!r}", sample.id)
                seen.add(sample.id)
                yield n, sample, None
            except BadLine as e:
                yield n, None, e


def _read_arrow(path: str) -> Iterator[Tuple[int, Optional[InputSample], Optional[BadLine]]]:
    try:
        import pyarrow.ipc
    except ImportError:
        raise BadLine(f"{path}: a prepared (Arrow) dataset needs pyarrow: pip install pyarrow") from None
    try:
        with open(os.path.join(path, "state.json")) as f:
            files = [d["filename"] for d in json.load(f)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadLine(f"{path}: not a readable datasets directory (state.json: {e})") from None
    row = 0
    for name in files:
        try:
            reader = pyarrow.ipc.open_stream(os.path.join(path, os.path.basename(name)))
        except (OSError, pyarrow.ArrowInvalid) as e:
            raise BadLine(f"{path}: {name}: {e}") from None
        for batch in reader:
            cols = batch.to_pydict()
            if "input_ids" not in cols:
                raise BadLine(f"{path}: no input_ids column (has {sorted(cols)})")
            masks = cols.get("loss_mask") or [None] * len(cols["input_ids"])
            for ids, mask in zip(cols["input_ids"], masks):
                row += 1
                try:
                    yield row, _sample({"id": str(row - 1), "input_ids": ids, "loss_mask": mask}, row, "row"), None
                except BadLine as e:
                    yield row, None, e


def parse_line(raw: bytes, n: int) -> InputSample:
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise BadLine(f"line {n}: not JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise BadLine(f"line {n}: not a JSON object")
    return _sample(obj, n, "line")


def _sample(obj: dict, n: int, where: str) -> InputSample:
    """One sample's fields checked; BadLine names `where` n (a line, or a prepared row)."""
    sid = obj.get("id")
    if not isinstance(sid, (str, int)) or isinstance(sid, bool) or str(sid) == "":
        raise BadLine(f"{where} {n}: 'id' must be a non-empty string or integer")
    ids = obj.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise BadLine(f"{where} {n}: 'input_ids' must be a non-empty list of non-negative integers", str(sid))
    mask = obj.get("loss_mask")
    if mask is not None and (not isinstance(mask, list) or len(mask) != len(ids)
                             or not all(m in (0, 1) for m in mask)):
        raise BadLine(f"{where} {n}: 'loss_mask' must be 0/1 values, one per input id", str(sid))
    return InputSample(n, str(sid), ids, mask)
