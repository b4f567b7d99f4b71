"""hscap verify throughput (GB/s of raw tensor data checked) and peak memory, on the same
synthetic dump as benchmarks/merge.py (H = 7168, 3 layers + final, bf16, 8192-token steps):
full decode at -j 1 and -j 2, and a --sample pass.

usage: python benchmarks/verify.py [--steps 8] [--step-tokens 8192] [--jobs 1 2] [--dir DIR]
                                   [--dump DIR] [--prefault-gb N] [--out FILE]
(--dump, --prefault-gb: as in benchmarks/merge.py; a dump merge.py kept there is reused)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from merge import H, STEP, make_or_reuse, prefault, run_hscap, write_results  # noqa: E402


def run_verify(dump: str, step_tokens: int, *args: str) -> dict:
    doc, rc, wall, peak = run_hscap("verify", dump, *args)
    st = doc["stats"]
    raw = st["steps_decoded"] * step_tokens * H * 4 * 2  # 3 layers + final, bf16
    return {"args": " ".join(args), "ok": doc["ok"], "exit": rc, "steps_decoded": st["steps_decoded"],
            "raw_GB": round(raw / 1e9, 3), "file_GB": round(st["bytes_read"] / 1e9, 3), "wall_s": round(wall, 2),
            "GBps_raw": round(raw / 1e9 / wall, 3), "peak_rss_MB_main": peak,
            "peak_rss_MB_per_worker": st.get("worker_peak_rss_mb")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--step-tokens", type=int, default=STEP)
    p.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dir", default=None)
    p.add_argument("--dump", default=None)
    p.add_argument("--prefault-gb", type=float, default=0)
    p.add_argument("--out", default=os.path.join(HERE, "verify.cpu2.results.json"))
    a = p.parse_args()
    prefault(a.dir or tempfile.gettempdir(), a.prefault_gb)
    work = tempfile.mkdtemp(prefix="hscap-verify-bench-", dir=a.dir)
    try:
        dump = a.dump or os.path.join(work, "dump")
        samples, _ = make_or_reuse(dump, a.steps, a.step_tokens)
        with open(os.path.join(dump, "bench.json")) as f:
            made = json.load(f)
        a.steps, a.step_tokens = made["steps"], made["step_tokens"]
        results = []
        for args in [["-j", str(j)] for j in a.jobs] + [["-j", str(a.jobs[-1]), "--sample", "2"]]:
            res = run_verify(dump, a.step_tokens, *args)
            results.append(res)
            print(json.dumps(res), flush=True)
        write_results(a.out, a.dir, f"{a.steps} steps x {a.step_tokens} tokens, H={H}, 3 layers + final, bf16 with "
                      f"outlier channels, {samples} whole samples, bytegroup level 1 (benchmarks/merge.py's "
                      "synthetic_dump)", results, cores=str(len(os.sched_getaffinity(0))), prefault_GB=str(a.prefault_gb),
                      note="peak_rss_MB_main: VmHWM of the verify process, reset at its start; per_worker: the "
                      "largest worker process's (with -j 1 the steps are checked in the main process)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
