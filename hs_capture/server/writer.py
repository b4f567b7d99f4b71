"""The background shard writer: compress, checksum, write atomically, then index.

The forward thread only stages tensors (staging.py) and enqueues a job. Worker
threads turn each job into one .hst file per part, each written under a temp
name, fsynced and renamed; only when every file of the step is durable is the
step's index line appended. In-flight memory is bounded: `block` (default)
makes the forward wait, `drop` skips the step and writes a `dropped` index line,
so no loss is ever silent. Before it comes to that, a writer that falls behind (steps waiting
for a thread hold over a quarter of the budget) writes steps raw until it catches up
(`on_backlog`); when even raw
writes cannot keep up the disk is the limit, and that is said once, with the rates.
"""

from __future__ import annotations

import errno
import queue
import threading
import time
from dataclasses import replace
from typing import Any, Dict, List, Optional, Sequence

import torch

from hs_capture.server.backlog import Backlog
from hs_capture.server.config import CaptureConfig, inflight_budget, writer_threads
from hs_capture.dump.paths import RankId
from hs_capture.dump.schema import IndexLine, RankMeta
from hs_capture.server.log import get_logger
from hs_capture.server.run_record import RunRecord
from hs_capture.server.staging import AsyncCopier, Staged, Stager
from hs_capture.server.step_files import INPUT_PARTS, remove_step_files, write_step_files

log = get_logger()


class ShardWriter:
    """One per writing rank. `submit` is the only call on the forward's critical path."""

    def __init__(self, cfg: CaptureConfig, rank: RankId, run_meta: RankMeta, expected_rows: int = 0,
                 step_sizes: Sequence[int] = (), copier: Optional[AsyncCopier] = None) -> None:
        """expected_rows: the most tokens one step can hold (chunked prefill size), for pinning ahead.
        step_sizes: the host bytes of one full step's tensors (sizes the default budget; pinned
        ahead by prewarm). copier: how device tensors reach the host (default: a CUDA side
        stream; see staging.py). The settings left at 0 (auto) are resolved here, into self.cfg."""
        threads = writer_threads(cfg)
        self.cfg = cfg = replace(cfg, writer_threads=threads,
                                 max_inflight_bytes=cfg.max_inflight_bytes or inflight_budget(threads, sum(step_sizes)))
        self.rank = rank
        self.run_dir = cfg.run_dir
        self.run_meta = replace(run_meta)  # a copy: the writer updates its state and counters
        self._step_sizes = list(step_sizes)
        self._stager = Stager(expected_rows, cfg.max_inflight_bytes, cfg.prewarm_steps, copier)
        self._backlog = Backlog(cfg.max_inflight_bytes)
        self._queue: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._index_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self.stats = {"steps_written": 0, "steps_dropped": 0, "steps_failed": 0, "steps_written_raw": 0,
                      "tokens_written": 0, "raw_bytes": 0, "file_bytes": 0}
        self._disk_bound_said = False
        self._threads: List[threading.Thread] = []
        self._closed = False
        self._next_step = 0
        self.failure: Optional[str] = None
        self.stopped: Optional[Dict[str, Any]] = None  # set once, when capture stops for good
        self._record = RunRecord(cfg, rank)

    @property
    def pinned_pool(self):
        return self._stager.pool

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._record.open()
        self.run_meta.status, self.run_meta.started = "running", time.time()
        self._write_meta()
        for i in range(self.cfg.writer_threads):
            t = threading.Thread(target=self._work, name=f"hscap-writer-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def close(self, timeout: float = 600.0) -> bool:
        """Drain every queued step, then record the run as closed. True if all finished."""
        if self._closed:
            return True
        self._closed = True
        deadline = time.monotonic() + timeout
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        done = not any(t.is_alive() for t in self._threads)
        self.run_meta.status, self.run_meta.closed = "closed" if done else "close_timed_out", time.time()
        self._record.free_reserve()
        try:
            self._write_meta()
        except OSError as e:  # a full disk must not turn a clean shutdown into a crash
            log.error("ERROR: rank %s: could not write the closing metadata: %s", self.rank.tag, e)
        self._stager.pool.trim()
        return done

    # ------------------------------------------------------------- hot path
    def submit(self, line: IndexLine, tensors: Dict[str, torch.Tensor],
               aux_layers: Optional[List[int]] = None) -> bool:
        """Stage one step (what the forward knows of it: `line`) and queue it. Blocks under
        back-pressure unless on_full=drop.

        `tensors["aux"]`, when present, is SGLang's packed [T, K*H] capture whose
        column blocks are `aux_layers` in order; it is split on the host, not the device.
        """
        if self._closed or self.stopped:
            return False
        step = self._next_step
        self._next_step += 1
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if not self._backlog.admit(nbytes, block=self.cfg.on_full == "block"):
            self._drop(step, line)
            return False
        if not self._disk_bound_said:
            with self._stats_lock:
                self._backlog.sample(self.stats["raw_bytes"], self.stats["file_bytes"])
            if self._backlog.held_too_long(self._forward_waited_s()):
                self._say_disk_bound()
        try:
            staged = self._stager.stage(tensors, inputs=INPUT_PARTS, block=self.cfg.on_full == "block")
        except BaseException:
            self._backlog.done(nbytes)
            raise
        if staged is None:  # every pinned buffer in flight, and the policy is drop
            self._backlog.done(nbytes)
            self._drop(step, line)
            return False
        self._backlog.queued(staged.nbytes)
        self._queue.put((step, line, staged, aux_layers or []))
        return True

    def _forward_waited_s(self) -> float:
        # a forward is held by the budget, or by every pinned buffer being in flight (the
        # buffers come back only once their step is on disk): both are the writer's pace
        return self._backlog.budget.waited_s + self._stager.pool.waited_s

    def _held_by(self) -> Dict[str, float]:
        """Which limit held the forwards: the bytes in flight, or every pinned buffer (one per
        step, whatever its size) being in flight; the second with few bytes waiting means many
        small steps."""
        pool = self._stager.pool
        return {"held_by_budget_s": round(self._backlog.budget.waited_s, 3),
                "held_by_pinned_s": round(pool.waited_s, 3), "pinned_buffers": pool.buffers}

    def _say_disk_bound(self) -> None:
        """Once, loudly: the writer held forwards although it writes raw when behind."""
        self._disk_bound_said = True
        with self._stats_lock:
            raw, disk, n_raw, n = (self.stats["raw_bytes"], self.stats["file_bytes"], self.stats["steps_written_raw"],
                                   self.stats["steps_written"])
            rates = self._backlog.rates(raw, disk, self._forward_waited_s())
            rates.update(self._held_by(), pinned_in_flight=self._stager.pool.in_flight())
            self.run_meta.disk_bound = rates
        if rates["held_by_pinned_s"] > rates["held_by_budget_s"] and 2 * rates["pinned_in_flight"] <= rates["pinned_buffers"]:
            # held by the pinned buffers while most are free: the steps outgrow the buffers
            why = "the steps are larger than the buffers pinned ahead, and wait for the few big enough"
        elif self.cfg.on_backlog == "raw":
            why = "the disk is the limit"
        else:
            why = "HSCAP_ON_BACKLOG=raw would let the writer catch up by writing raw"
        log.warning("WARNING: rank %s: capture cannot keep up: forwards held %.1f s so far (%.1f s by the in-flight "
                    "budget, %.1f s waiting for a pinned buffer, %d of %d in flight; policy block: nothing lost, the "
                    "server runs at the writer's pace). Over the last %.0f s: states produced at %.2f GB/s, written "
                    "at %.2f GB/s (%.2f GB/s to disk); %d of %d steps raw: %s", self.rank.tag,
                    rates["forward_waited_s"], rates["held_by_budget_s"], rates["held_by_pinned_s"],
                    rates["pinned_in_flight"], rates["pinned_buffers"], rates["window_s"], rates["produced_gbps"],
                    rates["written_gbps"], rates["to_disk_gbps"], n_raw, n, why)

    def _drop(self, step: int, line: IndexLine) -> None:
        self._count("steps_dropped")
        self._append_index(line.dropped_as(step, "writer_full", time.time()))
        log.warning("rank %s: writer full, dropped step %d (%d tokens); see the index",
                    self.rank.tag, step, line.num_tokens)

    # ------------------------------------------------------------- workers
    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            step, line, staged, aux_layers = job
            behind = self._backlog.picked(staged.nbytes)
            try:
                if self.stopped:
                    continue  # queued before the stop: released below, never written
                low = self._record.low_space()
                if low:
                    self._stop(step, low)
                    continue
                self._write_step(step, line, staged, aux_layers, behind)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    self._stop(step, f"disk full: {e.strerror}")
                else:
                    self._failed(step, e)
            except Exception as e:  # a failed step is counted and logged, never fatal
                self._failed(step, e)
            finally:
                self._stager.release(staged)
                self._backlog.done(staged.nbytes)

    def _failed(self, step: int, e: BaseException) -> None:
        self._count("steps_failed")
        self.failure = f"{type(e).__name__}: {e}"
        log.error("rank %s: step %d not written: %s", self.rank.tag, step, self.failure)

    def _stop(self, step: int, reason: str) -> None:
        """Stop capturing for good (the server keeps serving): recorded in the run metadata
        (if it still fits on the disk) and said loudly, once."""
        with self._stats_lock:
            if self.stopped:
                return
            self.stopped = {"reason": reason, "step": step, "time": time.time()}
        log.error("ERROR: rank %s: capture STOPPED at step %d: %s. The server keeps serving; "
                  "prefills from now on are not captured (re-send them after freeing space)",
                  self.rank.tag, step, reason)
        self.run_meta.capture_stopped = self.stopped
        self._record.free_reserve()
        try:
            self._write_meta()
        except OSError as e:
            log.error("ERROR: rank %s: could not record the stop in the run metadata: %s", self.rank.tag, e)

    def prewarm(self, sizes: Optional[List[int]] = None) -> None:
        """Pin host buffers for full-size steps (default: step_sizes) ahead of the first one (CUDA only)."""
        sizes = self._step_sizes if sizes is None else sizes
        if torch.cuda.is_available() and sizes:
            self._stager.prewarm_async(sizes)

    def _codec_now(self, behind: bool) -> str:
        """The configured codec, or raw when the writer is behind (on_backlog): the steps still
        waiting for a thread would fill the budget before a compressing thread came back."""
        if behind and self.cfg.on_backlog == "raw" and self.cfg.codec != "raw":
            return "raw"
        return self.cfg.codec

    def _write_step(self, step: int, line: IndexLine, staged: Staged, aux_layers: List[int],
                    behind: bool = False) -> None:
        """The step's files, then its index line: the commit (a step not indexed was never written)."""
        staged.ready()
        codec = self._codec_now(behind)
        header = {"run_id": self.cfg.run_id, "rank": self.rank.tag, "step": str(step)}
        written, raw_total, file_total = write_step_files(self.run_dir, self.rank, step, header, staged.tensors,
                                                          aux_layers, codec, self.cfg.level, self.cfg.fsync)
        try:
            self._append_index(line.committed(step, written, time.time()))
        except BaseException:  # not indexed: not committed, so leave no files that look written
            remove_step_files(self.run_dir, written)
            raise
        with self._stats_lock:
            self.stats["steps_written"] += 1
            self.stats["steps_written_raw"] += codec != self.cfg.codec
            self.stats["tokens_written"] += line.num_tokens
            self.stats["raw_bytes"] += raw_total
            self.stats["file_bytes"] += file_total

    # ------------------------------------------------------------- bookkeeping
    def _append_index(self, line: IndexLine) -> None:
        with self._index_lock:
            self._record.append_index(line)

    def _count(self, key: str) -> None:
        with self._stats_lock:
            self.stats[key] += 1

    def _write_meta(self) -> None:
        pool = self._stager.pool
        with self._stats_lock:
            self.run_meta.stats = {**self.stats, "pinned_bytes": pool.pinned_bytes,
                                   "pinned_allocs_in_forward": pool.hot_allocs,
                                   "forward_waited_s": round(self._forward_waited_s(), 3),
                                   **self._held_by(),  # over the whole run (the warning says it once)
                                   "peak_inflight_bytes": self._backlog.budget.peak,
                                   "inflight_budget_bytes": self._backlog.budget.limit,
                                   "writer_threads": self.cfg.writer_threads}
            self.run_meta.last_failure = self.failure
            meta = replace(self.run_meta)
        self._record.write_meta(meta)
