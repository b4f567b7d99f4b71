"""Feed the input file (inputs.py) to a running SGLang server so hs_capture dumps it: one
/generate per sample, rid = the sample's id, marked for capture (capture_policy.MARK), one
new token at temperature 0. Stdlib HTTP
only; never imports sglang."""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Set, Tuple

from hs_capture.dump.capture_policy import MARK
from hs_capture.offline.read.inputs import BadLine, InputSample


class ServerError(Exception):
    def __init__(self, message: str, retryable: bool) -> None:
        super().__init__(message)
        self.retryable = retryable


def post_generate(url: str, sample: InputSample, timeout: float) -> dict:
    # marked for capture: a server capturing a fraction of its traffic captures these whole
    body = json.dumps({"input_ids": sample.input_ids, "rid": sample.id, "extra_key": MARK,
                       "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read()[:300].decode(errors="replace").strip()
        raise ServerError(f"HTTP {e.code}: {detail}", retryable=e.code >= 500) from None
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ServerError(f"connection: {reason}", retryable=True) from None


@dataclass
class SendStats:
    sent: int = 0
    tokens: int = 0
    skipped_captured: int = 0
    bad_lines: int = 0
    failed: int = 0
    retries: int = 0
    stopped: bool = False  # a bad line stopped the run
    started: float = field(default_factory=time.monotonic)

    def rate(self) -> Tuple[float, float]:
        dt = max(1e-9, time.monotonic() - self.started)
        return self.sent / dt, self.tokens / dt


def send_one(url: str, sample: InputSample, retries: int, timeout: float, backoff: float,
             sleep: Callable[[float], None] = time.sleep) -> Tuple[Optional[str], int]:
    """Returns (error or None, retries used). Connection errors and 5xx back off and retry."""
    for attempt in range(retries + 1):
        try:
            post_generate(url, sample, timeout)
            return None, attempt
        except ServerError as e:
            if not e.retryable or attempt == retries:
                return str(e), attempt
            sleep(backoff * (2 ** attempt) * (0.5 + random.random()))
    return "unreachable", retries


def run(url: str, samples: Iterator[Tuple[int, Optional[InputSample], Optional[BadLine]]], *, concurrency: int,
        retries: int, timeout: float, backoff: float, skip: Callable[[InputSample], bool],
        on_failure: Callable[[dict], None], on_progress: Callable[[SendStats], None],
        stop_on_bad_line: bool) -> SendStats:
    """Send every sample with at most `concurrency` in flight; failures go to on_failure."""
    stats = SendStats()
    lock = threading.Lock()
    stop = threading.Event()

    def task(sample: InputSample) -> None:
        err, used = send_one(url, sample, retries, timeout, backoff)
        with lock:
            stats.retries += used
            if err is None:
                stats.sent += 1
                stats.tokens += len(sample.input_ids)
            else:
                stats.failed += 1
                on_failure({"id": sample.id, "line": sample.line, "error": err})
        on_progress(stats)

    with ThreadPoolExecutor(concurrency) as pool:
        pending: Set = set()
        for n, sample, error in samples:
            if error is not None:
                with lock:
                    stats.bad_lines += 1
                    on_failure({"id": error.id, "line": n, "error": str(error)})
                if stop_on_bad_line:
                    stop.set()
                    break
                continue
            if skip(sample):
                stats.skipped_captured += 1
                continue
            if len(pending) >= concurrency * 2:  # bounded read-ahead: huge datasets stream
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    fut.result()
            pending.add(pool.submit(task, sample))
        for fut in pending:
            fut.result()
    stats.stopped = stop.is_set()
    return stats
