"""The writer process: a rank's compression and disk writes, out of the server's process.

Writer threads inside SGLang's scheduler process compete with the scheduler for Python's
interpreter lock and slow every step it takes (benchmarks/gil_contention.py,
benchmarks/gpu/rate_sweep.py). So each writing rank starts one child process
(`python -m hs_capture.server.writer_process FD`) that runs the store's threads. The server
copies each step into a host buffer both processes map (a memfd, passed once by its fd, pinned
for the device copy), and sends the child the step's index line and layout once the copy is
done; the child writes and commits it, and says when the buffer may be reused.

Either side may die. The child ignores SIGINT and SIGTERM (the server decides when it ends):
when the server closes the channel, cleanly or by dying, the child drains every step it was
sent (its copy was complete when sent) and records the run as closed. When the child dies the
server stops capture loudly and serves on; a step not indexed was never written.
"""

from __future__ import annotations

import collections
import json
import mmap
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from hs_capture.dump.paths import RankId
from hs_capture.dump.schema import IndexLine, RankMeta
from hs_capture.server.channel import Channel
from hs_capture.server.config import CaptureConfig, ConfigError
from hs_capture.server.forward_cost import ServerThreads
from hs_capture.server.log import get_logger
from hs_capture.server.run_record import RunRecord
from hs_capture.server.store import STAT_KEYS, ShardStore, StoreWorkers, WriteJob

log = get_logger()

START_TIMEOUT_S = 60.0
# The writer runs below the server's priority: when the host's cores are short, the server's
# own processes come first (a writer that falls behind holds forwards, which is reported).
NICE = 5
# Hand-off "forward": while steps come, the forwards send them and read the writer's replies
# without waiting, and no thread of ours wakes per step (on a GPU it costs the server the same
# as the hand-off thread: benchmarks/README.md, run G). The replies thread wakes every ACTIVE_S
# to see whether the steps have stopped (none for QUIET_S); then it reads the replies and sends
# the steps owed, waking for each (TAIL_S at most while a copy runs).
ACTIVE_S = 0.5
QUIET_S = 0.05
TAIL_S = 0.05


class ProcessSink:
    """The server side of a writer process: starts it, hands it steps and buffers, hears back."""

    def __init__(self, cfg: CaptureConfig, rank: RankId, record: RunRecord, budget_bytes: int,
                 on_lost: Callable[[], None]) -> None:
        self.cfg, self.rank, self.record = cfg, rank, record
        self._budget = budget_bytes
        self._on_lost = on_lost
        self.stats: Dict[str, int] = dict.fromkeys(STAT_KEYS, 0)
        self.stopped: Optional[Dict[str, Any]] = None
        self.failure: Optional[str] = None
        self._jobs: Dict[int, Tuple[Any, Callable[[], None]]] = {}
        self._jobs_lock = threading.Lock()
        self._next_job = 0
        self._outbox: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._forward = cfg.handoff == "forward"  # no hand-off thread: the forwards send (_pump)
        self._pending: "collections.deque[tuple]" = collections.deque()
        self._pump_lock = threading.Lock()
        self._read_lock = threading.Lock()  # one reader of the replies at a time
        self._last_step = 0.0  # when a forward last handed a step over (monotonic)
        self._wake = threading.Event()  # the forwards found the writer gone
        self._gone = False
        self._closing = False
        self._closed_reply: Optional[tuple] = None
        self._ended = threading.Event()
        self._proc: Optional[subprocess.Popen] = None
        self._chan: Optional[Channel] = None
        self._threads: List[threading.Thread] = []
        self.threads = ServerThreads()  # what the two threads above cost the server's process

    def start(self, meta: RankMeta) -> None:
        self._meta = meta
        # as JSON, as it is stored: an object of torch's or SGLang's in it (torch.__version__
        # is one) would import that package in the child while the server waits for "ready".
        # Read back here first, so what the child cannot read fails before it starts.
        plain = json.dumps(meta.to_json(), default=str)
        RankMeta.from_json(json.loads(plain))
        self._chan, theirs = Channel.pair()
        env = dict(os.environ, HSCAP_DISABLE="1")  # the child runs no capture hook of its own
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "hs_capture.server.writer_process", str(theirs.fileno())],
                                          pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self._chan.send(("init", self.cfg, self.rank, plain, self._budget))
        self._chan.sock.settimeout(START_TIMEOUT_S)
        try:
            msg, _ = self._chan.recv()
        except (EOFError, OSError) as e:
            raise ConfigError(f"the writer process did not start (exit code {self._proc.poll()}): {e}") from None
        self._chan.sock.settimeout(None)
        if msg[0] != "ready":
            raise ConfigError(f"the writer process refused to start: {msg[1]}")
        log.info("rank %s: writer process %d started (%d threads)", self.rank.tag, self._proc.pid, self.cfg.writer_threads)
        self._threads = [threading.Thread(target=self._hear, name="hscap-hear", daemon=True)]
        if not self._forward:
            self._threads.append(threading.Thread(target=self._send_steps, name="hscap-send", daemon=True))
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------- server -> writer
    def add_buffer(self, buf: Any) -> None:
        """A new host buffer: the child maps it before any step in it reaches it."""
        if self._chan is not None and buf.fd >= 0:
            self._send(("buffer", buf.ident, buf.nbytes), [buf.fd])

    def put(self, step: int, line: IndexLine, staged: Any, aux_layers: List[int], done: Callable[[], None],
            held: bool = False) -> None:
        with self._jobs_lock:
            job = self._next_job
            self._next_job += 1
            self._jobs[job] = (staged, done)
        self._queue((job, step, line, staged, aux_layers, held))

    def drop(self, step: int, line: IndexLine) -> None:
        self._queue((None, step, line, None, None, False))

    def _queue(self, item: tuple) -> None:
        if self._forward:
            self._last_step = time.monotonic()
            self._pending.append(item)
            self._read_replies(0.0)
            self._pump()
        else:
            self._outbox.put(item)

    def wait_for_writer(self) -> None:
        """Hand-off "forward": a forward waits for a host buffer or the in-flight budget; it
        reads the writer's replies itself (they free what it waits for) and sends what is owed."""
        self._last_step = time.monotonic()
        self._read_replies(TAIL_S)
        self._pump()
        if self._gone:
            time.sleep(0.01)  # the replies thread is recording the loss and will wake it

    def _send(self, msg: tuple, fds: List[int] = ()) -> bool:
        try:
            self._chan.send(msg, fds)
            return True
        except OSError:
            return False  # the child is gone: _hear says so

    def _send_steps(self) -> None:
        """The hand-off thread: in order, wait for each step's device copy (off the forward),
        then send it."""
        while True:
            item = self._outbox.get()
            self.threads.tick("handoff")  # its CPU time up to here
            if item is None:
                return
            self._send_item(item)

    def _pump(self, wait: bool = False) -> None:
        """Hand-off "forward": send, in order, the queued steps whose copies are done (`wait`:
        all of them, waiting for their copies). Whoever holds the lock sends; the others go on."""
        if not self._pump_lock.acquire(blocking=wait):
            return
        try:
            while self._pending:
                item = self._pending[0]
                staged = item[3]
                if not wait and item[0] is not None and not _copied(staged):
                    return
                self._pending.popleft()
                self._send_item(item)
        finally:
            self._pump_lock.release()

    def _send_item(self, item: tuple) -> None:
        job, step, line, staged, aux_layers, held = item
        if job is None:
            self._send(("drop", step, line))
            return
        try:
            self.threads.wait_for_copy(staged.ready)
        except Exception as e:  # the copy failed: the step is not written, the server goes on
            self.failure = f"{type(e).__name__}: {e}"
            self._finish_job(job)
            return
        if not self._send(("step", job, step, line, staged.buffer.ident, staged.layout, aux_layers, staged.nbytes, held)):
            self._finish_job(job)

    # ------------------------------------------------------------- writer -> server
    def _hear(self) -> None:
        if self._forward:
            self._hear_when_quiet()
        else:
            while True:
                try:
                    msg, _ = self._chan.recv()
                except (EOFError, OSError):
                    break
                self.threads.tick("replies")
                self._on_reply(msg)
        self._ended.set()
        if not self._closed_reply and not self._closing:
            self._lost()
        self._finish_all()

    def _hear_when_quiet(self) -> None:
        while not self._gone:
            if time.monotonic() - self._last_step < QUIET_S:  # steps are coming: the forwards serve
                self._wake.wait(ACTIVE_S)
                continue
            self.threads.tick("replies")
            self._read_replies(TAIL_S if self._pending else ACTIVE_S)
            self._pump()

    def _read_replies(self, wait: float) -> None:
        """Every reply that has come (first waiting up to `wait` seconds for one, if any is
        owed); the writer's end is noted for the replies thread."""
        if not self._read_lock.acquire(blocking=wait > 0):
            return
        try:
            if wait > 0:
                try:
                    if not select.select([self._chan.sock], [], [], wait)[0]:
                        return
                except (OSError, ValueError):
                    self._note_gone()
                    return
            while True:
                try:
                    got = self._chan.try_recv()
                except (EOFError, OSError):
                    self._note_gone()
                    return
                if got is None:
                    return
                self._on_reply(got[0])
        finally:
            self._read_lock.release()

    def _note_gone(self) -> None:
        self._gone = True
        self._wake.set()

    def _on_reply(self, msg: tuple) -> None:
        if msg[0] == "done":
            _, job, stats, stopped, failure = msg
            self.stats, self.failure = stats, failure or self.failure
            if stopped and not self.stopped:
                self.stopped = stopped
            self._finish_job(job)
        elif msg[0] == "closed":
            self._closed_reply = msg
            self.stats = msg[2]

    def _finish_job(self, job: int) -> None:
        with self._jobs_lock:
            entry = self._jobs.pop(job, None)
        if entry is not None:
            entry[1]()

    def _finish_all(self) -> None:
        with self._jobs_lock:
            jobs = list(self._jobs)
        for job in jobs:
            self._finish_job(job)

    def _lost(self) -> None:
        """The child died under a running server: stop capture loudly, serve on."""
        try:
            code = self._proc.wait(5) if self._proc is not None else None
        except subprocess.TimeoutExpired:  # it closed the channel and lives on: end it
            self._proc.kill()
            code = "killed: it had closed the channel"
        reason = f"the writer process exited (code {code}); steps it had not indexed are not in the dump"
        store = ShardStore(self.cfg, self.rank, self._meta, self.record)
        store.stats.update(self.stats)
        try:  # said loudly and recorded first; then no forward waits for the writer any longer
            store.stop(None, reason, "re-send them; the server's log above may say why the writer died")
        except Exception as e:
            log.error("ERROR: rank %s: could not record the writer's loss: %s", self.rank.tag, e)
        self.stopped = store.stopped or {"reason": reason, "step": None, "time": time.time()}
        self._on_lost()

    # ------------------------------------------------------------- close
    def close(self, timeout: float, forward: Callable[[], Dict[str, Any]]) -> bool:
        """forward: the server side's counters, read once the hand-off thread has drained."""
        self._closing = True
        if self._forward:
            self._pump(wait=True)
            self._last_step = 0.0  # the replies thread hears the rest
        else:
            self._outbox.put(None)
            self._threads[-1].join(timeout)
        if not self._ended.is_set():
            self._send(("close", timeout, forward()))
            self._ended.wait(timeout + 10)
        if self._proc is not None:
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._chan is not None:
            self._chan.close()
        return bool(self._closed_reply and self._closed_reply[1])


def _copied(staged: Any) -> bool:
    """The step's device copy is done (a failed one counts as done: sending it finds the error)."""
    event = getattr(staged, "event", None)
    if event is None:
        return True
    try:
        return bool(event.query())
    except Exception:
        return True


# ----------------------------------------------------------------- the child
def main(argv: List[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        os.nice(NICE)
    except OSError:
        pass
    chan = Channel.from_fd(int(argv[0]))
    try:
        (kind, cfg, rank, plain, budget), _ = chan.recv()
        meta = RankMeta.from_json(json.loads(plain))
        record = RunRecord(cfg, rank)
        record.adopt()  # the server claimed the rank
        store = ShardStore(cfg, rank, meta, record)
        store.begin()
        workers = StoreWorkers(store, cfg.writer_threads, budget)
        workers.start()
    except Exception as e:
        chan.send(("error", f"{type(e).__name__}: {e}"))
        return 1
    chan.send(("ready",))
    maps: Dict[int, np.ndarray] = {}
    timeout, forward, gone = 600.0, {}, False

    replies = threading.Lock()  # the counters go out in the order they were read: never backwards

    def done_with(job: int) -> Callable[[], None]:
        def done() -> None:
            try:
                with replies:
                    chan.send(("done", job, store.snapshot(), store.stopped, store.failure))
            except OSError:
                pass  # the server is gone: the step is on disk all the same
        return done

    while True:
        try:
            msg, fds = chan.recv()
        except (EOFError, OSError):
            gone = True
            break
        kind = msg[0]
        if kind == "buffer":
            _, ident, nbytes = msg
            maps[ident] = np.frombuffer(mmap.mmap(fds[0], nbytes, prot=mmap.PROT_READ), dtype=np.uint8)
            os.close(fds[0])
        elif kind == "step":
            _, job, step, line, ident, layout, aux_layers, nbytes, held = msg
            workers.put(WriteJob(step, line, maps[ident], layout, aux_layers, nbytes, lambda: None, done_with(job), held))
        elif kind == "drop":
            store.drop(msg[1], msg[2])
        elif kind == "close":
            _, timeout, forward = msg
            break
    finished = workers.close(timeout)
    if gone:
        log.warning("rank %s: the server closed without a word: the writer wrote every step it was sent and "
                    "closes the run", rank.tag)
    store.finish(finished, forward)
    if not gone:
        try:
            with replies:  # after every "done": the counters never go backwards
                chan.send(("closed", finished, store.snapshot()))
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
