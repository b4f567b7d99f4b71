"""Where merge's and verify's time goes on a many-core host (a diagnosis, not a figure):
worker start-up, per-core rates, a -j 1 profile, and what the machine's memory and tmpfs
allow when every core writes fresh pages at once.

usage: python benchmarks/gpu/merge_diag.py [--steps 32] [--dir /dev/shm] [--jobs 1 4 16]
(on an offline machine: `bash benchmarks/gpu/device.sh offline python3
benchmarks/gpu/merge_diag.py`; a run on a 16-core host is in benchmarks/gpu/merge_diag.results.txt)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, REPO)

from merge import STEP, dump_bytes, run_merge, synthetic_dump  # noqa: E402
from verify import run_verify  # noqa: E402


def emit(what: str, **kv) -> None:
    print(json.dumps({"what": what, **kv}), flush=True)


def imports(n: int) -> float:
    t0 = time.perf_counter()
    ps = [subprocess.Popen([sys.executable, "-c", "import hs_capture.offline.merge"], cwd=REPO) for _ in range(n)]
    for p in ps:
        p.wait()
    return round(time.perf_counter() - t0, 2)


def _touch(args) -> dict:
    """Fresh 1 GB buffers: fill (first touch), refill (reused), write to tmpfs."""
    import numpy as np

    d, i = args
    t0 = time.perf_counter()
    a = np.ones(1 << 30, dtype=np.uint8)
    t1 = time.perf_counter()
    a[:] = 2
    t2 = time.perf_counter()
    path = os.path.join(d, f"touch-{i}")
    with open(path, "wb") as f:
        f.write(memoryview(a))
    t3 = time.perf_counter()
    os.remove(path)
    return {"fresh_GBps": round(1.07 / (t1 - t0), 2), "reused_GBps": round(1.07 / (t2 - t1), 2),
            "tmpfs_write_GBps": round(1.07 / (t3 - t2), 2)}


def memory(d: str, n: int) -> dict:
    import multiprocessing

    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        t0 = time.perf_counter()
        rs = list(pool.map(_touch, [(d, i) for i in range(n)]))
        wall = time.perf_counter() - t0
    keys = rs[0].keys()
    return {"procs": n, "wall_s": round(wall, 2), **{k: round(sum(r[k] for r in rs) / n, 2) for k in keys}}


def profile(fn, top: int = 30) -> str:
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--step-tokens", type=int, default=STEP)
    p.add_argument("--dir", default="/dev/shm")
    p.add_argument("--jobs", type=int, nargs="+", default=[1, 4, 16])
    a = p.parse_args()
    cores = len(os.sched_getaffinity(0))
    emit("imports", one_s=imports(1), parallel_s=imports(cores), procs=cores)
    emit("memory", **memory(a.dir, 1))
    emit("memory", **memory(a.dir, cores))
    work = tempfile.mkdtemp(prefix="hscap-diag-", dir=a.dir)
    try:
        dump = os.path.join(work, "dump")
        t0 = time.perf_counter()
        samples = synthetic_dump(dump, a.steps, step_tokens=a.step_tokens, threads=cores)
        emit("dump", steps=a.steps, samples=samples, GB=round(dump_bytes(dump) / 1e9, 2),
             made_s=round(time.perf_counter() - t0, 1))
        for j in a.jobs:
            out = os.path.join(work, f"out-{j}")
            emit("merge", **run_merge(dump, out, "specforge", j))
            shutil.rmtree(out)
        for j in a.jobs:
            emit("verify", **run_verify(dump, a.step_tokens, "-j", str(j)))
        from hs_capture.offline.merge import merge
        from hs_capture.offline.verify import verify

        out = os.path.join(work, "out-prof")
        print(profile(lambda: merge([dump], out, "specforge", jobs=1, cache_bytes=1 << 30)), flush=True)
        shutil.rmtree(out)
        print(profile(lambda: verify([dump], jobs=1)), flush=True)  # -j 1: in this process, profiled
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
