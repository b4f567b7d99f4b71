"""The writing side of a rank: worker threads that compress, checksum and write each step's
files atomically, then commit it with its index line; the run's counters and metadata.

Torch-free: it runs wherever the writer runs (in the writer process by default, see
writer_process.py; in the server's own process with HSCAP_WRITER=thread). A step reaches it
as a `WriteJob`: its index line, one host buffer and the place of each tensor in it.
"""

from __future__ import annotations

import errno
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from hs_capture.dump.paths import RankId
from hs_capture.dump.schema import IndexLine, RankMeta
from hs_capture.server.config import CaptureConfig
from hs_capture.server.log import get_logger
from hs_capture.server.run_record import RunRecord
from hs_capture.server.step_files import Placed, remove_step_files, write_step_files

log = get_logger()

STAT_KEYS = ("steps_written", "steps_dropped", "steps_failed", "steps_written_raw", "tokens_written",
             "raw_bytes", "file_bytes")


@dataclass
class WriteJob:
    step: int
    line: IndexLine
    memory: np.ndarray  # the step's host buffer (uint8)
    layout: Sequence[Placed]
    aux_layers: List[int]
    nbytes: int
    ready: Callable[[], None]  # blocks until the buffer holds the step (the device copy is done)
    done: Callable[[], None]  # the buffer may be reused
    held: bool = False  # the forward waited for the writer (the budget or a host buffer) to hand it over


class ShardStore:
    """What one writing rank has put on disk, and its record: counters, failure, stop."""

    def __init__(self, cfg: CaptureConfig, rank: RankId, run_meta: RankMeta, record: RunRecord) -> None:
        self.cfg = cfg
        self.rank = rank
        self.run_meta = replace(run_meta)  # a copy: the store updates its state and counters
        self.record = record
        self.stats: Dict[str, int] = dict.fromkeys(STAT_KEYS, 0)
        self.failure: Optional[str] = None
        self.stopped: Optional[Dict[str, Any]] = None  # set once, when capture stops for good
        self.forward: Dict[str, Any] = {}  # the server side's counters, merged into the metadata
        self._index_lock = threading.Lock()
        self._stats_lock = threading.Lock()

    def begin(self) -> None:
        self.run_meta.status, self.run_meta.started = "running", time.time()
        self.write_meta()

    def snapshot(self) -> Dict[str, int]:
        with self._stats_lock:
            return dict(self.stats)

    # ------------------------------------------------------------- one step
    def write(self, job: WriteJob, codec: str) -> None:
        """The step's files, then its index line: the commit (a step not indexed was never
        written). A failure is counted and logged, a full disk stops capture; never raises."""
        try:
            if self.stopped:
                return  # queued before the stop: never written
            low = self.record.low_space()
            if low:
                self.stop(job.step, low)
                return
            job.ready()
            header = {"run_id": self.cfg.run_id, "rank": self.rank.tag, "step": str(job.step)}
            written, raw_total, file_total = write_step_files(self.cfg.run_dir, self.rank, job.step, header, job.memory,
                                                              job.layout, job.aux_layers, codec, self.cfg.level,
                                                              self.cfg.fsync)
            try:
                self.append_index(job.line.committed(job.step, written, time.time()))
            except BaseException:  # not indexed: not committed, so leave no files that look written
                remove_step_files(self.cfg.run_dir, written)
                raise
            with self._stats_lock:
                self.stats["steps_written"] += 1
                self.stats["steps_written_raw"] += codec != self.cfg.codec
                self.stats["tokens_written"] += job.line.num_tokens
                self.stats["raw_bytes"] += raw_total
                self.stats["file_bytes"] += file_total
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self.stop(job.step, f"disk full: {e.strerror}")
            else:
                self._failed(job.step, e)
        except Exception as e:  # a failed step is counted and logged, never fatal
            self._failed(job.step, e)

    def drop(self, step: int, line: IndexLine) -> None:
        """A step the server could not stage (policy drop): indexed as dropped, never silent."""
        with self._stats_lock:
            self.stats["steps_dropped"] += 1
        try:
            self.append_index(line.dropped_as(step, "writer_full", time.time()))
        except OSError as e:
            self._failed(step, e)
        log.warning("rank %s: writer full, dropped step %d (%d tokens); see the index",
                    self.rank.tag, step, line.num_tokens)

    def _failed(self, step: int, e: BaseException) -> None:
        with self._stats_lock:
            self.stats["steps_failed"] += 1
        self.failure = f"{type(e).__name__}: {e}"
        log.error("rank %s: step %d not written: %s", self.rank.tag, step, self.failure)

    def stop(self, step: Optional[int], reason: str,
             advice: str = "re-send them after freeing space") -> None:
        """Stop capturing for good (the server keeps serving): recorded in the run metadata
        (if it still fits on the disk) and said loudly, once."""
        with self._stats_lock:
            if self.stopped:
                return
            self.stopped = {"reason": reason, "step": step, "time": time.time()}
        log.error("ERROR: rank %s: capture STOPPED%s: %s. The server keeps serving; "
                  "prefills from now on are not captured (%s)",
                  self.rank.tag, "" if step is None else f" at step {step}", reason, advice)
        self.run_meta.capture_stopped = self.stopped
        self.record.free_reserve()
        try:
            self.write_meta()
        except OSError as e:
            log.error("ERROR: rank %s: could not record the stop in the run metadata: %s", self.rank.tag, e)

    # ------------------------------------------------------------- record
    def append_index(self, line: IndexLine) -> None:
        with self._index_lock:
            self.record.append_index(line)

    def finish(self, done: bool, forward: Dict[str, Any]) -> None:
        """The run's closing record: every queued step drained (`done`) or not, with the server
        side's counters (`forward`; its disk-bound report, if it made one)."""
        forward = dict(forward)
        self.run_meta.disk_bound = forward.pop("disk_bound", None) or self.run_meta.disk_bound
        self.forward = forward
        self.run_meta.status = "closed" if done else "close_timed_out"
        self.run_meta.closed = time.time()
        self.record.free_reserve()
        try:
            self.write_meta()
        except OSError as e:  # a full disk must not turn a clean shutdown into a crash
            log.error("ERROR: rank %s: could not write the closing metadata: %s", self.rank.tag, e)

    def write_meta(self) -> None:
        with self._stats_lock:
            self.run_meta.stats = {**self.stats, **self.forward}
            self.run_meta.last_failure = self.failure
            meta = replace(self.run_meta)
        self.record.write_meta(meta)


class StoreWorkers:
    """The threads that write queued steps. A writer that falls behind writes steps raw until
    it catches up (on_backlog=raw): behind is steps waiting for a thread holding over a quarter
    of the in-flight budget (they would fill it before a compressing thread came back), or a
    step whose forward waited for the writer to hand it over. The first alone never fired at
    full-size steps (Kimi-K2.5's widths): the budget HSCAP_MAX_INFLIGHT_MB=0 (auto) sets holds
    every thread's step and four more, so no more than a quarter ever waits."""

    def __init__(self, store: ShardStore, threads: int, budget_bytes: int,
                 clock: Optional[Callable[[], None]] = None) -> None:
        """clock: called by each thread after each step (ServerThreads.tick, where the threads run
        in the server's process)."""
        self.store = store
        self._clock = clock
        self._limit = budget_bytes
        self._queue: "queue.Queue[Optional[WriteJob]]" = queue.Queue()
        self._waiting = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, name=f"hscap-writer-{i}", daemon=True)
                         for i in range(threads)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def put(self, job: WriteJob) -> None:
        with self._lock:
            self._waiting += job.nbytes
        self._queue.put(job)

    def _picked(self, job: WriteJob) -> bool:
        """A thread took a step: is the writer behind?"""
        with self._lock:
            self._waiting -= job.nbytes
            return self._waiting * 4 > self._limit or job.held

    def _codec(self, behind: bool) -> str:
        cfg = self.store.cfg
        if behind and cfg.on_backlog == "raw" and cfg.codec != "raw":
            return "raw"
        return cfg.codec

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self.store.write(job, self._codec(self._picked(job)))
            finally:
                job.done()
                if self._clock is not None:
                    self._clock()

    def close(self, timeout: float) -> bool:
        """Drain every queued step. True if all finished within the timeout."""
        deadline = time.monotonic() + timeout
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)

    @property
    def count(self) -> int:
        return len(self._threads)
