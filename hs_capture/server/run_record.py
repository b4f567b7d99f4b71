"""One writing rank's record of its run on disk, apart from the step files themselves: its
claim on the rank, the space held in reserve for a last word, the run metadata and the index.
The writer (writer.py) decides what to say; this module says it durably."""

from __future__ import annotations

import json
import os
from typing import Optional

from hs_capture.dump import files
from hs_capture.server.config import CaptureConfig, ConfigError
from hs_capture.dump.paths import RankId, claim_path, index_path, rank_dirs, rank_meta_path, reserve_path
from hs_capture.dump.schema import IndexLine, RankMeta

_RESERVE_BYTES = 256 << 10


class RunRecord:
    def __init__(self, cfg: CaptureConfig, rank: RankId) -> None:
        self.cfg = cfg
        self.rank = rank
        self.run_dir = cfg.run_dir
        self._reserve: Optional[str] = None

    def open(self) -> None:
        """Make the rank's dirs, claim the rank, hold space in reserve. ConfigError: claimed."""
        for d in rank_dirs(self.run_dir, self.rank):
            os.makedirs(d, exist_ok=True)
        # A second server given the same HSCAP_RUN_ID must not write over the first one's
        # files (O_EXCL: exactly one process wins).
        claim = claim_path(self.run_dir, self.rank)
        try:
            os.close(os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            raise ConfigError(f"run {self.cfg.run_id!r} rank {self.rank.tag} already exists in {self.cfg.dump_dir}: "
                              "another server wrote (or writes) it; unset HSCAP_RUN_ID or choose a new one") from None
        # Space kept back so the run metadata can still record a full disk (freed at the stop).
        self._reserve = reserve_path(self.run_dir, self.rank)
        try:
            with open(self._reserve, "wb") as f:
                f.write(bytes(_RESERVE_BYTES))
        except OSError:
            self._reserve = None

    def adopt(self) -> None:
        """Take over a record another process opened (the writer process, from the server)."""
        path = reserve_path(self.run_dir, self.rank)
        self._reserve = path if os.path.exists(path) else None

    def free_reserve(self) -> None:
        if self._reserve:
            files.remove_quietly([self._reserve])
            self._reserve = None

    def low_space(self) -> Optional[str]:
        """Why the dump dir is below HSCAP_MIN_FREE_GB, or None."""
        if self.cfg.min_free_bytes <= 0:
            return None
        try:
            st = os.statvfs(self.run_dir)
        except OSError:
            return None
        free = st.f_bavail * st.f_frsize
        if free < self.cfg.min_free_bytes:
            return (f"free space {free / 2**30:.2f} GB is below HSCAP_MIN_FREE_GB="
                    f"{self.cfg.min_free_bytes / 2**30:g}")
        return None

    def append_index(self, line: IndexLine) -> None:
        """One write() of a whole line under O_APPEND: a crash leaves at most a torn last line.
        Callers serialise appends (one lock per rank)."""
        data = (json.dumps(line.to_json(), separators=(",", ":"), ensure_ascii=True) + "\n").encode()
        fd = os.open(index_path(self.run_dir, self.rank), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            if self.cfg.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def write_meta(self, meta: RankMeta) -> None:
        data = json.dumps(meta.to_json(), indent=1, sort_keys=True, default=str).encode()
        files.atomic_write(rank_meta_path(self.run_dir, self.rank), [data], self.cfg.fsync)
