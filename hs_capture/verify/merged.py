"""Verify `hscap merge` output in any of its formats: every sample present, loadable, with
its format's keys, dtypes and shapes, token ids equal to the dataset, and sane values.

Formats are recognised by their files (index.json of the native format, *.ckpt, *.pt,
hs_*.safetensors); merge_report.json, when there, says which samples merge left out and why.
Torch files are opened with weights_only=True: nothing read is ever unpickled as code."""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import format as fmt
from ..layout import MERGE_REPORT, NATIVE_INDEX, TEMP_MARK
from ..reader import first_mismatch
from .pool import bounded_map, pick
from .report import Report
from .values import identical_pairs, value_problems



@dataclass
class Item:
    """One merged sample to check: where it is and how to read it."""

    fmt: str
    path: str  # file
    rid: Optional[str] = None  # known from the file name / index (None: read from the file)
    row: Optional[int] = None
    key: Optional[str] = None  # native: the row's tensor prefix


def is_merged(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MERGE_REPORT)) or os.path.isfile(os.path.join(path, NATIVE_INDEX))


def _stem_rid_map(rids: Sequence[str]) -> Dict[str, str]:
    from ..formats import sample_file_stem

    return {sample_file_stem(r): r for r in rids}


def discover(root: str, report: Report, order: Optional[List[str]]) -> Tuple[List[Item], Dict[str, str]]:
    """Items under a merged dir, and rid -> reason for samples merge reported incomplete."""
    items: List[Item] = []
    incomplete: Dict[str, str] = {}
    rpath = os.path.join(root, MERGE_REPORT)
    if os.path.isfile(rpath):
        try:
            with open(rpath) as f:
                rep = json.load(f)
            incomplete = {str(k): str(v) for k, v in (rep.get("incomplete") or {}).items()}
            report.stats.setdefault("merge_reports", []).append({k: rep.get(k) for k in ("format", "shard", "layers")})
        except (OSError, ValueError, AttributeError) as e:
            report.add("samples", f"merge report unreadable: {e}", path=rpath)
    stems = _stem_rid_map(order) if order else {}
    index = os.path.join(root, NATIVE_INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                idx = json.load(f)
            for rid, row, shard, _n in idx["samples"]:
                if os.path.isabs(shard) or os.path.normpath(shard).startswith(".."):
                    raise ValueError(f"shard path {shard!r} leaves the dataset dir")
                items.append(Item("hscap", os.path.join(root, shard), str(rid), int(row), str(row)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            report.add("samples", f"native index unreadable: {e}", path=index)
    for dirpath, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            full = os.path.join(dirpath, name)
            if TEMP_MARK in name:
                report.add("files", "temp file left by an interrupted merge", path=full)
            elif name.endswith(".ckpt") or (name.endswith(".pt")):
                stem = name.rsplit(".", 1)[0]
                items.append(Item("specforge" if name.endswith(".ckpt") else "modelopt", full, stems.get(stem)))
            elif name.startswith("hs_") and name.endswith(".safetensors"):
                try:
                    row = int(name[3:-len(".safetensors")])
                except ValueError:
                    row = None
                rid = order[row] if order and row is not None and row < len(order) else None
                items.append(Item("speculators", full, rid, row))
    if os.path.isfile(index):  # shards not named by index.json are extra
        named = {os.path.normpath(i.path) for i in items if i.fmt == "hscap"}
        sdir = os.path.join(root, "shards")
        for name in sorted(os.listdir(sdir)) if os.path.isdir(sdir) else []:
            full = os.path.normpath(os.path.join(sdir, name))
            if name.endswith(".hst") and TEMP_MARK not in name and full not in named:
                report.add("files", "shard not listed in index.json", path=full)
    return items, incomplete


# ----------------------------------------------------------------- loading, one per format
def _np(t) -> np.ndarray:
    import torch

    t = t.detach()
    return (t.float() if t.is_floating_point() else t.to(torch.int64)).numpy()


def _load_torch(path: str) -> dict:
    import torch

    d = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(d, dict):
        raise ValueError(f"holds a {type(d).__name__}, not a dict")
    return d


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


def load_safetensors(path: str, dtypes: Optional[Dict[str, str]] = None) -> Tuple[Dict[str, np.ndarray], Dict[str, str]]:
    """A safetensors file as float32/int64 numpy arrays (bf16 widened), checked rule by rule.
    `dtypes`, when given, receives each tensor's stored safetensors dtype."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise fmt.HeaderTooSmall(f"{size} bytes: no safetensors header")
        (n,) = struct.unpack("<Q", f.read(8))
        if 8 + n > size or n > fmt.MAX_HEADER_BYTES:
            raise (fmt.HeaderTooLarge if n > fmt.MAX_HEADER_BYTES else fmt.Truncated)(
                f"header length {n} runs past the end of the {size}-byte file")
        try:
            header = json.loads(f.read(n))
            meta = header.pop("__metadata__", {}) or {}
        except (ValueError, AttributeError) as e:
            raise fmt.InvalidHeader(f"header is not a JSON object: {e}") from None
        out, end = {}, 0
        for name, e in header.items():
            try:
                a, b = e["data_offsets"]
                shape, dt = [int(x) for x in e["shape"]], e["dtype"]
            except (TypeError, KeyError, ValueError):
                raise fmt.TensorInvalidInfo(f"{name}: incomplete entry") from None
            count = int(np.prod(shape)) if shape else 1
            item = 2 if dt == "BF16" else np.dtype(_ST_DTYPES.get(dt, np.uint8)).itemsize
            if dt not in _ST_DTYPES and dt != "BF16":
                raise fmt.TensorInvalidInfo(f"{name}: dtype {dt} not expected here")
            if b - a != count * item or a < 0:
                raise fmt.InvalidOffset(f"{name}: offsets [{a}, {b}) disagree with shape {shape} of {dt}")
            if 8 + n + b > size:
                raise fmt.Truncated(f"{name}: data ends at {8 + n + b}, past the end of the {size}-byte file")
            f.seek(8 + n + a)
            raw = f.read(b - a)
            if dtypes is not None:
                dtypes[name] = dt
            out[name] = fmt.to_numpy(raw, "bfloat16", shape) if dt == "BF16" else \
                np.frombuffer(raw, dtype=np.dtype(_ST_DTYPES[dt]).newbyteorder("<")).reshape(shape).astype(
                    np.float32 if dt.startswith("F") else np.int64)
            end = max(end, b)
        if 8 + n + end != size:
            raise (fmt.Truncated if 8 + n + end > size else fmt.TrailingBytes)(
                f"payload ends at {8 + n + end} but the file has {size} bytes")
    return out, meta


@dataclass
class Loaded:
    rid: Optional[str]
    input_ids: np.ndarray
    loss_mask: Optional[np.ndarray]
    aux: np.ndarray  # (T, K*H)
    final: Optional[np.ndarray]  # (T, H) post-norm
    prenorm: Optional[np.ndarray]  # (T, H)
    hidden_size: int
    dtype: str = "float32"  # the states' stored dtype (the arrays above are widened to float32)


def load_item(item: Item, headers: Dict[str, fmt.Header]) -> Loaded:
    """Read one merged sample in its format's layout. KeyError / ValueError: wrong layout."""
    if item.fmt == "specforge":
        d = _load_torch(item.path)
        ids, aux, fin = d["input_ids"], d["aux_hidden_state"], d["hidden_state"]
        if aux.dim() != 3 or aux.shape[0] != 1 or fin.dim() != 3 or fin.shape[0] != 1:
            raise ValueError(f"aux_hidden_state {list(aux.shape)} / hidden_state {list(fin.shape)} are not (1, T, *)")
        _dtypes(d, {"input_ids": "int64", "loss_mask": "int64"})
        return Loaded(item.rid, _np(ids), _np(d["loss_mask"]), _np(aux[0]), _np(fin[0]), None, fin.shape[-1],
                      _torch_dtype(fin))
    if item.fmt == "modelopt":
        d = _load_torch(item.path)
        _dtypes(d, {"input_ids": "int64", "loss_mask": "int64"})
        rid = d.get("conversation_id")
        fin = d["hidden_states"]
        return Loaded(str(rid) if rid is not None else item.rid, _np(d["input_ids"]), _np(d["loss_mask"]),
                      _np(d["aux_hidden_states"]), _np(fin), None, fin.shape[-1], _torch_dtype(fin))
    if item.fmt == "speculators":
        dtypes: Dict[str, str] = {}
        arrays, meta = load_safetensors(item.path, dtypes)
        hs, ids = arrays["hidden_states"], arrays["token_ids"]
        if hs.ndim != 3 or hs.shape[1] != 4:
            raise ValueError(f"hidden_states is {list(hs.shape)}, not [T, 4, H]")
        t, _, h = hs.shape
        return Loaded(meta.get("rid", item.rid), ids, None, hs[:, :3].reshape(t, 3 * h), None, hs[:, 3], h,
                      _ST_NAMES.get(dtypes.get("hidden_states", ""), "float32"))
    # native
    with open(item.path, "rb") as f:
        header = headers.get(item.path)
        if header is None:
            header = headers[item.path] = fmt.read_header(f, os.fstat(f.fileno()).st_size)
        got, dtype = {}, "float32"
        for name in ("aux", "final", "input_ids", "loss_mask", "prenorm"):
            e = header.tensors.get(f"{item.key}/{name}")
            if e is not None:
                got[name] = fmt.to_numpy(fmt.read_tensor_bytes(f, header, e.name), e.dtype, e.shape)
                dtype = e.dtype if name == "final" else dtype
    fin = got["final"]
    return Loaded(item.rid, got["input_ids"], got["loss_mask"], got["aux"], fin, got.get("prenorm"), fin.shape[-1],
                  dtype)


_ST_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _torch_dtype(t) -> str:
    return str(t.dtype).replace("torch.", "")


def _dtypes(d: dict, want: Dict[str, str]) -> None:
    for k, v in want.items():
        if str(d[k].dtype).replace("torch.", "") != v:
            raise ValueError(f"{k} is {d[k].dtype}, the format needs {v}")


# ----------------------------------------------------------------- checks
def check_item(item: Item, report: Report, dataset: Optional[Dict[str, List[int]]],
               headers: Dict[str, fmt.Header], seen: Dict[str, str]) -> Optional[Loaded]:
    report.looked("samples")
    try:
        s = load_item(item, headers)
    except fmt.Truncated as e:
        report.add("truncated", str(e), path=item.path)
        return None
    except (fmt.ChecksumMismatch, fmt.CodecError, fmt.SizeMismatch) as e:
        report.add("checksum", str(e), path=item.path)
        return None
    except fmt.FormatError as e:
        report.add("header", f"{type(e).__name__}: {e}", path=item.path)
        return None
    except KeyError as e:
        report.add("samples", f"lacks key {e} of the {item.fmt} format", path=item.path, rid=item.rid)
        return None
    except (ValueError, RuntimeError, OSError, EOFError, TypeError, AttributeError) as e:
        # torch.load's errors on a damaged file are RuntimeError/EOFError/pickle errors
        report.add("header", f"cannot load as {item.fmt}: {str(e).splitlines()[0][:200]}", path=item.path)
        return None
    except Exception as e:  # pickle.UnpicklingError and friends from a corrupt torch file
        report.add("header", f"cannot load as {item.fmt}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}",
                   path=item.path)
        return None
    rid = s.rid
    if rid is not None:
        with report._lock:
            other = seen.setdefault(rid, item.path)
        if other != item.path:
            report.add("samples", f"the sample is also in {other}", path=item.path, rid=rid)
    t, h = len(s.input_ids), s.hidden_size
    report.looked("shapes")
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
    for p in problems:
        report.add("shapes", p, path=item.path, rid=rid)
    if problems:
        return None
    named = {f"aux[{j}]": s.aux[:, j * h:(j + 1) * h] for j in range(s.aux.shape[1] // h)}
    if s.final is not None:
        named["final"] = s.final
    if s.prenorm is not None:
        named["prenorm"] = s.prenorm
    report.looked("nonfinite")
    report.looked("degenerate")
    for name, a in named.items():
        for check, msg in value_problems(a):
            report.add(check, f"{name}: {msg}", path=item.path, rid=rid)
    report.looked("identical")
    for a, b in identical_pairs(named):
        report.add("identical", f"{a} and {b} are bit-identical (the same layer written twice?)",
                   path=item.path, rid=rid)
    if dataset is not None and rid is not None and rid in dataset:
        report.looked("tokens")
        want, have = dataset[rid], s.input_ids.tolist()
        k = first_mismatch(have, want)
        if k is not None:
            report.add("tokens", f"token ids differ from the dataset at position {k} "
                                 f"(lengths {len(have)} vs {len(want)})", path=item.path, rid=rid)
    return s


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
        report.add("samples", "no merged sample found (no *.ckpt, *.pt, hs_*.safetensors or index.json)",
                   path=",".join(paths))
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
    headers: Dict[str, fmt.Header] = {}
    seen: Dict[str, str] = {}
    for _ in bounded_map(lambda it: check_item(it, report, dataset, headers, seen), todo, jobs, progress):
        pass
    return items
