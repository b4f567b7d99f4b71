"""hscap merge throughput (GB/s of raw tensor data) and peak memory, on a synthetic dump of
realistic shape: H = 7168, 3 captured layers + final, bf16 with LLM-like outlier channels,
mixed sample lengths batched into 8192-token steps, written by the real ShardWriter.

usage: python benchmarks/merge.py [--steps 8] [--step-tokens 8192] [--jobs 1 2] [--dir DIR]
                                  [--dump DIR] [--prefault-gb N] [--out FILE]
--dir: where the dump and outputs go, e.g. /dev/shm to take the disk out of the figure.
--dump: keep the dump there, or reuse the one already there (benchmarks/verify.py takes it).
--prefault-gb: write and delete N GB in --dir first, so a freshly booted VM's first touch of
  its memory (2-10x slower than reused memory) is not charged to the first run measured.
Figures include each run's process start (hscap in a fresh process) and are only steady-
state when the dump is large beside it: a -j N run decodes about N - 1 steps twice (where
two workers' runs meet), so bytes read ~ (steps + N - 1) / steps of the dump.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Tuple

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hs_capture.server.config import CaptureConfig  # noqa: E402
from hs_capture.dump.paths import RankId  # noqa: E402
from hs_capture.server.writer import ShardWriter  # noqa: E402
from hs_capture.dump.schema import RankMeta, step_line  # noqa: E402
from tests.sglang_cpu.chained import chained_steps, positions  # noqa: E402

H, LAYERS, STEP = 7168, [2, 30, 58], 8192


def synthetic_dump(root: str, steps: int, seed: int = 0, step_tokens: int = STEP, threads: int = 4,
                   distinct: int = 4) -> int:
    """Returns the number of samples. Lengths 64..4096, packed into steps like SGLang's
    chunked prefill (a sample may continue in the next step). The states of `distinct` steps
    are generated and cycled (random generation, not writing, was most of a large dump's time);
    token ids and positions are each step's own."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    cfg = CaptureConfig(dump_dir=root, run_id="run-bench", layers=LAYERS, writer_threads=threads, fsync=False)
    w = ShardWriter(cfg, RankId(), RankMeta(layers=LAYERS, hidden_size=H, num_layers=61))
    w.start()
    outliers = torch.randperm(H, generator=g)[:16]
    made = []
    all_seqs, whole = chained_steps(rng, steps, step_tokens, 64, 4096)
    for k, seqs in enumerate(all_seqs):
        def states(k):
            x = torch.randn(step_tokens, k * H, generator=g)
            x.view(step_tokens, k, H)[:, :, outliers] *= 50
            return x.to(torch.bfloat16)

        if len(made) < distinct:
            made.append((states(3), states(1)))
        aux, final = made[k % len(made)]
        tensors = {"aux": aux, "final": final,
                   "tokens": torch.randint(0, 100000, (step_tokens,), generator=g), "positions": positions(seqs)}
        w.submit(step_line("EXTEND", step_tokens, step_tokens, "bfloat16", seqs), tensors, aux_layers=LAYERS)
    w.close()
    return whole  # whole samples (the last, unfinished one is incomplete: merge skips it)


# A child's peak-RSS counter starts at its parent's (Linux keeps it across fork and exec, and
# the benchmark holds the synthetic tensors): the child resets it first (clear_refs 5) and
# reports its VmHWM at the end. Worker processes (-j) report their own through hscap's JSON.
_WITH_PEAK = ("import json, sys\nopen('/proc/self/clear_refs', 'w').write('5')\n"
              "from hs_capture.cli import main; sys.argv = ['hscap'] + sys.argv[1:]\n"
              "try:\n    main()\nfinally:\n"
              "    import re; r = int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1))\n"
              "    print(json.dumps({'peak_rss_mb': round(r / 1024)}), file=sys.stderr)")


def run_hscap(*args: str) -> Tuple[dict, int, float, int]:
    """`hscap ARGS --json` in a fresh process: (its JSON output, exit code, wall s, peak RSS MB)."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _WITH_PEAK, *args, "--json"], capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - t0
    assert p.stdout.strip(), p.stderr[-2000:]
    peak = json.loads(p.stderr.strip().splitlines()[-1])["peak_rss_mb"]
    return json.loads(p.stdout.strip().splitlines()[-1]), p.returncode, wall, peak


def dump_bytes(dump: str) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(dump) for n in ns)


def run_merge(dump: str, out: str, fmt: str, jobs: int) -> dict:
    summary, rc, wall, peak = run_hscap("merge", dump, "-o", out, "--format", fmt, "-j", str(jobs),
                                        "--cache-mb", "1024")
    assert rc == 0, summary
    return {"format": fmt, "jobs": jobs, "samples": summary["written"], "raw_GB": round(summary["raw_bytes"] / 1e9, 3),
            "wall_s": round(wall, 2), "GBps_raw": round(summary["raw_bytes"] / 1e9 / wall, 3),
            "bytes_in_GB": round(summary["bytes_in"] / 1e9, 3),
            "read_amplification": round(summary["bytes_in"] / dump_bytes(dump), 3),
            "bytes_out_GB": round(summary["bytes_out"] / 1e9, 3), "peak_rss_MB_main": peak,
            "peak_rss_MB_per_worker": summary["worker_peak_rss_mb"]}


def write_results(out: str, where: str, dump: str, results: list, **extra: str) -> None:
    """The results file: when, on what machine and disk, which dump, then every run's figures."""
    doc = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()}, {os.cpu_count()} cpus",
           "dir": where or tempfile.gettempdir(), "dump": dump, **extra, "results": results}
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def prefault(where: str, gb: float) -> None:
    """Write and delete `gb` GB in `where` from every core at once (see --prefault-gb)."""
    if gb <= 0:
        return
    cores = len(os.sched_getaffinity(0))
    each = int(gb * 1e9 / cores)
    code = ("import os, sys; p = sys.argv[1]; b = bytes(1 << 24); f = open(p, 'wb')\n"
            "for _ in range(int(sys.argv[2]) >> 24): f.write(b)\nf.close(); os.remove(p)")
    ps = [subprocess.Popen([sys.executable, "-c", code, os.path.join(where, f"prefault-{k}"), str(each)])
          for k in range(cores)]
    for p in ps:
        p.wait()


def make_or_reuse(dump: str, steps: int, step_tokens: int) -> Tuple[int, float]:
    """(whole samples, seconds to make it): a dump already at `dump` is reused as it is."""
    marker = os.path.join(dump, "bench.json")
    if os.path.exists(marker):
        with open(marker) as f:
            return json.load(f)["samples"], 0.0
    t0 = time.perf_counter()
    samples = synthetic_dump(dump, steps, step_tokens=step_tokens, threads=len(os.sched_getaffinity(0)))
    made = time.perf_counter() - t0
    with open(marker, "w") as f:
        json.dump({"samples": samples, "steps": steps, "step_tokens": step_tokens}, f)
    return samples, made


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--step-tokens", type=int, default=STEP)
    p.add_argument("--dir", default=None)
    p.add_argument("--dump", default=None)
    p.add_argument("--prefault-gb", type=float, default=0)
    p.add_argument("--jobs", type=int, nargs="+", default=[1, 2])
    p.add_argument("--formats", nargs="+", default=["specforge", "hscap"])
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "merge.cpu2.results.json"))
    a = p.parse_args()
    prefault(a.dir or tempfile.gettempdir(), a.prefault_gb)
    work = tempfile.mkdtemp(prefix="hscap-merge-bench-", dir=a.dir)
    try:
        dump = a.dump or os.path.join(work, "dump")
        samples, made = make_or_reuse(dump, a.steps, a.step_tokens)
        size = dump_bytes(dump)
        results = []
        for fmt in a.formats:
            for jobs in a.jobs:
                out = os.path.join(work, f"out-{fmt}-{jobs}")
                res = run_merge(dump, out, fmt, jobs)
                results.append(res)
                print(json.dumps(res), flush=True)
                shutil.rmtree(out)
        write_results(a.out, a.dir, f"{a.steps} steps x {a.step_tokens} tokens, H={H}, layers {LAYERS} + final, bf16 "
                      f"with outlier channels, {samples} whole samples of 64..4095 tokens, bytegroup level 1; "
                      f"{size / 1e9:.2f} GB on disk, written in {made:.1f}s", results,
                      prefault_GB=str(a.prefault_gb), cores=str(len(os.sched_getaffinity(0))))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
