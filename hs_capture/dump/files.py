"""Files that are whole or absent: written under a temp name, fsynced, renamed into place. A
leaf (stdlib and layout only): the writer in the server and merge offline both use it."""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, List

from hs_capture.dump.paths import temp_name


def atomic_file(path: str, write: Callable[[str], None]) -> int:
    """write(a temp sibling), then rename it into place; returns the file's size. On any error
    the temp file is removed and nothing appears at `path`."""
    tmp = temp_name(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        remove_quietly([tmp])
        raise
    return os.path.getsize(path)


def atomic_write(path: str, chunks: List[Any], fsync: bool) -> int:
    """atomic_file of these chunks (buffers), fsynced before the rename when asked. Returns
    the bytes written."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            for c in chunks:
                f.write(c)
            if fsync:
                f.flush()
                os.fsync(f.fileno())

    return atomic_file(path, write)


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
