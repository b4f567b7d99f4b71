"""What the per-format modules share: file names from ids, atomic files, torch helpers
(imported lazily: the registry must load without torch)."""

from __future__ import annotations

import hashlib
import os
from typing import Callable

import numpy as np

from ..files import remove_quietly
from ..layout import safe_component, temp_name


def sample_file_stem(rid: str) -> str:
    """A path-safe, collision-free file stem for a sample id."""
    digest = hashlib.sha1(rid.encode()).hexdigest()[:10]
    return f"{safe_component(rid, 80)}-{digest}"


def atomic_file(path: str, write: Callable[[str], None]) -> int:
    """write(temp path), then rename into place; returns the file's size."""
    tmp = temp_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        remove_quietly([tmp])
        raise
    return os.path.getsize(path)


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
        raise ValueError(f"holds a {type(d).__name__}, not a dict")
    return d


def check_dtypes(d: dict, want: dict) -> None:
    for k, v in want.items():
        if dtype_name(d[k]) != v:
            raise ValueError(f"{k} is {d[k].dtype}, the format needs {v}")


def stem_of(name: str, suffix: str):
    return (name[: -len(suffix)], None) if name.endswith(suffix) else None
