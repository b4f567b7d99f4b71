"""One writing rank's record of its run on disk, apart from the step files themselves: its
claim on the rank, the space held in reserve for a last word, the run metadata and the index.
The writer (writer.py) decides what to say; this module says it durably."""

from __future__ import annotations

import json
import os
import re
from typing import Optional, Tuple

from hs_capture.dump import files
from hs_capture.server.config import CaptureConfig, ConfigError, host_memory
from hs_capture.dump.paths import RankId, claim_path, index_path, rank_dirs, rank_meta_path, reserve_path
from hs_capture.dump.schema import IndexLine, RankMeta

_RESERVE_BYTES = 256 << 10
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
MOUNTINFO = "/proc/self/mountinfo"
MEMINFO = "/proc/meminfo"
CGROUP_MEMORY = ("/sys/fs/cgroup", "/sys/fs/cgroup/memory")  # v2, then v1: the process's own in a container
# A dump dir in memory: capture stops before the host's available memory falls below this share
# of it, since past that the kernel's OOM killer takes the largest process, SGLang's scheduler.
MEMORY_FLOOR_SHARE = 0.05


def filesystem_type(path: str) -> Optional[str]:
    """The type of the filesystem `path` is on (Linux's mount table; None where unknown)."""
    real = os.path.realpath(path)
    try:
        with open(MOUNTINFO, errors="surrogateescape") as f:  # a mount point's name may be any bytes
            lines = f.read().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or not right:
            continue
        mount = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # a space is \040
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):  # the longest; of equals, the last mounted (on top)
            best, kind = mount, right.split()[0]
    return kind


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _cgroup_memory() -> Optional[Tuple[int, int]]:
    """(limit, use) of this process's memory cgroup, where it has a limit; its inactive file
    cache is not use (the kernel reclaims it before it kills). tmpfs pages count against it."""
    for root, limit_name, use_name, inactive in ((CGROUP_MEMORY[0], "memory.max", "memory.current", "inactive_file"),
                                                 (CGROUP_MEMORY[1], "memory.limit_in_bytes", "memory.usage_in_bytes",
                                                  "total_inactive_file")):
        limit, use = _read_int(os.path.join(root, limit_name)), _read_int(os.path.join(root, use_name))
        if limit is None or use is None or limit >= 1 << 60:  # "max" (v2) or no limit (v1)
            continue
        try:
            with open(os.path.join(root, "memory.stat")) as f:
                stat = dict(line.split()[:2] for line in f if line.strip())
            use -= int(stat.get(inactive, 0))
        except (OSError, ValueError):
            pass
        return limit, max(0, use)
    return None


def available_memory() -> Optional[Tuple[int, int]]:
    """(bytes available, bytes in all) to this process: the host's MemAvailable and memory, or
    its memory cgroup's headroom and limit where those are less (a container); None where unknown."""
    avail = None
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    total = host_memory() or 0
    cgroup = _cgroup_memory()
    if cgroup is not None:
        limit, use = cgroup
        avail = limit - use if avail is None else min(avail, limit - use)
        total = min(total, limit) if total else limit
    return None if avail is None else (avail, total)


def memory_floor(min_free_bytes: int, total: int, inflight_bytes: int) -> int:
    """The available memory below which capture into a dump dir in memory stops: 5% of the
    memory (or HSCAP_MIN_FREE_GB, if more), plus what the steps in flight may still write."""
    return max(min_free_bytes, int(total * MEMORY_FLOOR_SHARE)) + inflight_bytes


class RunRecord:
    def __init__(self, cfg: CaptureConfig, rank: RankId) -> None:
        self.cfg = cfg
        self.rank = rank
        self.run_dir = cfg.run_dir
        self._reserve: Optional[str] = None
        try:
            fs = filesystem_type(cfg.dump_dir)
        except Exception:  # an unreadable mount table: judged by free space alone, never fatal
            fs = None
        self.in_memory: Optional[str] = fs if fs in MEMORY_FILESYSTEMS else None  # the dump takes the host's memory

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

    def memory(self) -> Optional[Tuple[int, int, int]]:
        """(memory available, memory_floor, memory in all) where the dump dir is in memory and
        this host says how much is available; else None."""
        memory = available_memory() if self.in_memory else None
        if memory is None:
            return None
        avail, total = memory
        return avail, memory_floor(self.cfg.min_free_bytes, total, self.cfg.max_inflight_bytes), total

    def low_space(self) -> Optional[str]:
        """Why the dump dir is below HSCAP_MIN_FREE_GB, or, in memory, the memory available
        below memory_floor; or None."""
        memory = self.memory()
        if memory is not None and memory[0] < memory[1]:
            return (f"the dump dir is in memory ({self.in_memory}) and the memory available "
                    f"{memory[0] / 2**30:.2f} GB is below {memory[1] / 2**30:.2f} GB")
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
