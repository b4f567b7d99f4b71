"""Files that are whole or absent: written under a temp name, fsynced, renamed into place. A
leaf (stdlib and layout only): the writer in the server and merge offline both use it."""

from __future__ import annotations

import os
from typing import Any, Iterable, List

from .layout import temp_name


def atomic_write(path: str, chunks: List[Any], fsync: bool) -> int:
    """Write chunks to a temp sibling, fsync, rename into place. Returns bytes written."""
    tmp = temp_name(path)
    written = 0
    try:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
                written += len(c) if isinstance(c, (bytes, bytearray)) else memoryview(c).nbytes
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_quietly([tmp])
        raise
    return written


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_quietly(paths: Iterable[str]) -> None:
    for p in paths:
        try:
            os.remove(p)
        except OSError:
            pass
