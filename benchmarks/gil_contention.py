"""What writer threads in a process cost a thread of it that runs many small Python and torch
operations, as SGLang's scheduler does: compression in threads of the same process vs the
same compression in another process.

A "scheduler" thread runs small torch ops and Python bookkeeping for --seconds and counts its
iterations; beside it, N threads (or N processes) encode bf16 states with the .hst encoder
(bytegroup level 1, hs_capture's default) in a loop. The ratio to the run with no writer is
what the writer costs the scheduler. Every figure of a run is measured in that one run.

usage: python benchmarks/gil_contention.py [--writers 1,2] [--seconds 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def encode_forever(stop) -> None:
    import torch

    from hs_capture.dump import hst

    x = torch.randn(8192, 1024).to(torch.bfloat16)
    raw = memoryview(x.view(torch.uint8).numpy()).cast("B")
    while not stop.is_set():
        hst.encode_file([hst.RawTensor("hidden", "bfloat16", [8192, 1024], raw)], {"part": "final"}, "bytegroup", 1)


def scheduler_rate(seconds: float) -> float:
    """Iterations per second of a loop of small torch ops and Python work."""
    import torch

    a = torch.randn(64, 64)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(100):
            a = a + 1
            a = a * 0.5
            d = {"k": [1, 2, 3]}
            sum(d["k"])
        n += 100
    return n / (time.perf_counter() - t0)


def run(kind: str, writers: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    stop = ctx.Event() if kind == "process" else threading.Event()
    if kind == "process":
        workers = [ctx.Process(target=encode_forever, args=(stop,)) for _ in range(writers)]
    else:
        workers = [threading.Thread(target=encode_forever, args=(stop,), daemon=True) for _ in range(writers)]
    for w in workers:
        w.start()
    time.sleep(2.0)  # the writers are up and encoding
    rate = scheduler_rate(seconds)
    stop.set()
    for w in workers:
        w.join()
    return rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--writers", default="1")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--out")
    a = ap.parse_args()
    base = scheduler_rate(a.seconds)
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cores": os.cpu_count(),
           "alone_iterations_per_s": round(base), "runs": []}
    for n in (int(x) for x in a.writers.split(",")):
        for kind in ("thread", "process"):
            rate = run(kind, n, a.seconds)
            res["runs"].append({"writers": n, "kind": kind, "iterations_per_s": round(rate),
                                "vs_alone": round(rate / base, 3)})
            print(json.dumps(res["runs"][-1]), flush=True)
    res["alone_again_iterations_per_s"] = round(scheduler_rate(a.seconds))
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
