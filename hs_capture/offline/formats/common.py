"""What the per-format modules share: file names from ids, torch helpers (imported lazily:
the registry must load without torch). Files are written with files.atomic_file/atomic_write."""

from __future__ import annotations

import hashlib

import numpy as np

from hs_capture.dump.hst import InvalidHeader, TensorInvalidInfo
from hs_capture.dump.paths import safe_component


def sample_file_stem(rid: str) -> str:
    """A path-safe, collision-free file stem for a sample id."""
    digest = hashlib.sha1(rid.encode()).hexdigest()[:10]
    return f"{safe_component(rid, 80)}-{digest}"


def aux_of(s):
    """The captured layers concatenated in layer order: (T, K*H)."""
    import torch

    return torch.cat([s.layers[k] for k in sorted(s.layers)], dim=-1)


def to_numpy(t) -> np.ndarray:
    import torch

    t = t.detach()
    return (t.float() if t.is_floating_point() else t.to(torch.int64)).numpy()


def dtype_name(t) -> str:
    return str(t.dtype).replace("torch.", "")


def load_torch_dict(path: str) -> dict:
    import torch

    d = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(d, dict):
        raise InvalidHeader(f"holds a {type(d).__name__}, not a dict")
    return d


def check_dtypes(d: dict, want: dict) -> None:
    for k, v in want.items():
        if dtype_name(d[k]) != v:
            raise TensorInvalidInfo(f"{k} is {d[k].dtype}, the format needs {v}")


def stem_of(name: str, suffix: str):
    return (name[: -len(suffix)], None) if name.endswith(suffix) else None
