"""The server side of a writing rank: stage each step off the device and hand it to the writer.

The forward thread only stages tensors (staging.py) and hands the step on; the writing itself
(compress, checksum, write atomically, then index: store.py) runs in a writer process of the
rank's own (writer_process.py, the default) or, with HSCAP_WRITER=thread, in threads of this
process. In-flight memory is bounded: `block` (default) makes the forward wait, `drop` skips
the step and writes a `dropped` index line, so no loss is ever silent. Before it comes to that,
a writer that falls behind writes steps raw until it catches up (`on_backlog`); when even raw
writes cannot keep up the disk is the limit, and that is said once, with the rates. What the
hook cost the forwards, by cause, is said at close and kept in the run metadata.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from hs_capture.server.backlog import Backlog
from hs_capture.server.config import CaptureConfig, inflight_budget, writer_threads
from hs_capture.dump.paths import RankId
from hs_capture.dump.schema import IndexLine, RankMeta
from hs_capture.server.forward_cost import SCHEDULER, AllocatorCounters, ForwardCost, ServerThreads
from hs_capture.server.log import get_logger
from hs_capture.server.run_record import RunRecord
from hs_capture.server.staging import AsyncCopier, Staged, Stager
from hs_capture.server.step_files import INPUT_PARTS
from hs_capture.server.store import ShardStore, StoreWorkers, WriteJob
from hs_capture.server.writer_process import ProcessSink

log = get_logger()


class ThreadSink:
    """The store's threads in this process (HSCAP_WRITER=thread)."""

    def __init__(self, cfg: CaptureConfig, rank: RankId, record: RunRecord, budget_bytes: int) -> None:
        self.cfg, self.rank, self.record, self._budget = cfg, rank, record, budget_bytes
        self.store: Optional[ShardStore] = None
        self.workers: Optional[StoreWorkers] = None
        self.threads = ServerThreads()

    def start(self, meta: RankMeta) -> None:
        self.store = ShardStore(self.cfg, self.rank, meta, self.record)
        self.store.begin()
        self.workers = StoreWorkers(self.store, self.cfg.writer_threads, self._budget,
                                    clock=lambda: self.threads.tick("writer"))
        self.workers.start()

    @property
    def stats(self) -> Dict[str, int]:
        return self.store.stats

    @property
    def stopped(self) -> Optional[Dict[str, Any]]:
        return self.store.stopped if self.store else None

    @property
    def failure(self) -> Optional[str]:
        return self.store.failure if self.store else None

    def put(self, step: int, line: IndexLine, staged: Staged, aux_layers: List[int], done: Callable[[], None],
            held: bool = False) -> None:
        self.workers.put(WriteJob(step, line, staged.buffer.tensor.numpy(), staged.layout, aux_layers, staged.nbytes,
                                  lambda: self.threads.wait_for_copy(staged.ready), done, held))

    def drop(self, step: int, line: IndexLine) -> None:
        self.store.drop(step, line)

    def close(self, timeout: float, forward: Callable[[], Dict[str, Any]]) -> bool:
        """forward: the server side's counters, read once the threads have drained."""
        done = self.workers.close(timeout)
        self.store.finish(done, forward())
        return done


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
        self.run_meta = replace(run_meta)
        self._step_sizes = list(step_sizes)
        self._stager = Stager(expected_rows, cfg.max_inflight_bytes, cfg.prewarm_steps, copier)
        self._backlog = Backlog(cfg.max_inflight_bytes)
        self._record = RunRecord(cfg, rank)
        if cfg.writer == "process":
            self._sink = ProcessSink(cfg, rank, self._record, cfg.max_inflight_bytes, self._writer_lost)
            self._stager.pool.on_new = self._sink.add_buffer
        else:
            self._sink = ThreadSink(cfg, rank, self._record, cfg.max_inflight_bytes)
        self.cost = ForwardCost()
        self._allocator = AllocatorCounters()
        self._disk_bound_said = False
        self._closed = False
        self._next_step = 0

    def in_memory(self) -> Optional[str]:
        """Where the dump dir is in memory (tmpfs): what the log says of the floor capture keeps."""
        fs = self._record.in_memory
        if not fs:
            return None
        memory = self._record.memory()
        if memory is None:
            return f"the dump dir is in memory ({fs}); this host does not say how much memory is available"
        _, floor, total = memory
        return (f"the dump dir is in memory ({fs}): capture stops when the memory available falls below "
                f"{floor / 2**30:.1f} GB (5% of {total / 2**30:.0f} GB and the in-flight budget)")

    @property
    def pinned_pool(self):
        return self._stager.pool

    @property
    def stats(self) -> Dict[str, int]:
        return self._sink.stats

    @property
    def stopped(self) -> Optional[Dict[str, Any]]:
        return self._sink.stopped

    @property
    def failure(self) -> Optional[str]:
        return self._sink.failure

    # ------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._record.open()
        self._allocator.start()
        try:
            self._sink.start(self.run_meta)
            if self.cfg.handoff == "forward":  # no thread hears the writer while a forward waits
                self._stager.pool.wait_with = self._backlog.budget.wait_with = self._sink.wait_for_writer
        except Exception as e:
            if not isinstance(self._sink, ProcessSink):
                raise
            # capture must not stop a server: the writing goes on in this process's threads
            log.warning("WARNING: rank %s: %s; writing in threads of the server's process instead "
                        "(slower prefill at high state rates)", self.rank.tag, e)
            self.cfg = replace(self.cfg, writer="thread")
            self._stager.pool.on_new = None
            self._sink = ThreadSink(self.cfg, self.rank, self._record, self.cfg.max_inflight_bytes)
            self._sink.start(self.run_meta)

    def close(self, timeout: float = 600.0) -> bool:
        """Drain every queued step, then record the run as closed. True if all finished."""
        if self._closed:
            return True
        self._closed = True
        done = self._sink.close(timeout, self.forward_stats)
        self._stager.pool.trim()
        return done

    def _writer_lost(self) -> None:
        """The writer process died: no forward may wait for it any longer."""
        self._stager.pool.abort()
        self._backlog.budget.abort()

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
        self.cost.step()
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        block = self.cfg.on_full == "block"
        budget_waited = self._backlog.budget.waited_s
        admitted = self._backlog.admit(nbytes, block=block)
        budget_waited = self._backlog.budget.waited_s - budget_waited
        self.cost.add("budget_wait", budget_waited)
        if not admitted:
            if not self.stopped:
                self._sink.drop(step, line)
            return False
        if not self._disk_bound_said:
            self._backlog.sample(self.stats["raw_bytes"], self.stats["file_bytes"])
            if self._backlog.held_too_long(self._forward_waited_s()):
                self._say_disk_bound()
        t0, pool_waited = time.perf_counter(), self._stager.pool.waited_s
        try:
            staged = self._stager.stage(tensors, inputs=INPUT_PARTS, block=block)
        except BaseException:
            self._backlog.done(nbytes)
            raise
        finally:
            waited = self._stager.pool.waited_s - pool_waited
            self.cost.add("buffer_wait", waited)
            self.cost.add("staging", time.perf_counter() - t0 - waited)
        if staged is None:  # every buffer in flight and the policy is drop, or the writer is gone
            self._backlog.done(nbytes)
            if not self.stopped:
                self._sink.drop(step, line)
            return False
        t0 = time.perf_counter()
        held = budget_waited > 0 or waited > 0  # the writer held this forward: it is behind
        self._sink.put(step, line, staged, aux_layers or [], lambda: self._release(staged, nbytes), held)
        self.cost.add("handoff", time.perf_counter() - t0)
        return True

    def _release(self, staged: Staged, nbytes: int) -> None:
        self._stager.release(staged)
        self._backlog.done(nbytes)

    def _forward_waited_s(self) -> float:
        # a forward is held by the budget, or by every host buffer being in flight (the
        # buffers come back only once their step is on disk): both are the writer's pace
        return self._backlog.budget.waited_s + self._stager.pool.waited_s

    def _held_by(self) -> Dict[str, float]:
        """Which limit held the forwards: the bytes in flight, or every host buffer (one per
        step, whatever its size) being in flight; the second with few bytes waiting means many
        small steps."""
        pool = self._stager.pool
        return {"held_by_budget_s": round(self._backlog.budget.waited_s, 3),
                "held_by_pinned_s": round(pool.waited_s, 3), "pinned_buffers": pool.buffers}

    def forward_stats(self) -> Dict[str, Any]:
        """The server side's counters, for the run metadata and the closing line."""
        pool = self._stager.pool
        return {"pinned_bytes": pool.pinned_bytes, "pinned_allocs_in_forward": pool.hot_allocs,
                "forward_waited_s": round(self._forward_waited_s(), 3),
                **self._held_by(),  # over the whole run (the warning says it once)
                "peak_inflight_bytes": self._backlog.budget.peak,
                "inflight_budget_bytes": self._backlog.budget.limit,
                "writer_threads": self.cfg.writer_threads, "writer": self.cfg.writer, "handoff": self.cfg.handoff,
                "forward_cost": self.cost.report(),
                "server_threads": self._sink.threads.report(),
                "scheduler_cost": SCHEDULER.report(),
                "cuda_allocator": self._allocator.report(),
                "disk_bound": self.run_meta.disk_bound}

    def _say_disk_bound(self) -> None:
        """Once, loudly: the writer held forwards although it writes raw when behind."""
        self._disk_bound_said = True
        stats = dict(self.stats)
        raw, disk, n_raw, n = (stats["raw_bytes"], stats["file_bytes"], stats["steps_written_raw"],
                               stats["steps_written"])
        rates = self._backlog.rates(raw, disk, self._forward_waited_s())
        rates.update(self._held_by(), pinned_in_flight=self._stager.pool.in_flight())
        self.run_meta.disk_bound = rates
        if rates["held_by_pinned_s"] > rates["held_by_budget_s"] and 2 * rates["pinned_in_flight"] <= rates["pinned_buffers"]:
            # held by the host buffers while most are free: the steps outgrow the buffers
            why = "the steps are larger than the buffers pinned ahead, and wait for the few big enough"
        elif self.cfg.on_backlog == "raw" and n_raw == 0 and self.cfg.codec != "raw":
            why = "compressing and writing are the limit (no step was yet far enough behind to be written raw)"
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

    def prewarm(self, sizes: Optional[List[int]] = None) -> None:
        """Pin host buffers for full-size steps (default: step_sizes) ahead of the first one (CUDA only)."""
        sizes = self._step_sizes if sizes is None else sizes
        if torch.cuda.is_available() and sizes:
            self._stager.prewarm_async(sizes)
