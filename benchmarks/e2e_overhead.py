"""Prefill throughput of the REAL SGLang server on this CPU with capture on vs off, in one
run: the same seeded requests, sent by `hscap send` at the same concurrency, servers
started alternately (off, on, off, on, ...) so drift on a noisy machine hits both sides.

usage: python benchmarks/e2e_overhead.py [--rounds 3] [--samples 48] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.sglang_cpu.harness import Server, make_tiny_deepseek, server_env  # noqa: E402


def dataset(path: str, samples: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    tokens = 0
    with open(path, "w") as f:
        for i in range(samples):
            n = rng.randrange(64, 1024)
            tokens += n
            f.write(json.dumps({"id": f"b{i}", "input_ids": [rng.randrange(2, 1000) for _ in range(n)]}) + "\n")
    return tokens


def one_round(model: str, data: str, tokens: int, capture: bool, work: str, concurrency: int,
              extra_env: dict, both_env: dict) -> dict:
    dump = os.path.join(work, "dump")
    shutil.rmtree(dump, ignore_errors=True)
    env = server_env(dump if capture else None, HSCAP_LAYERS="1,3,5", **(extra_env if capture else {}), **both_env)
    srv = Server(model, env, os.path.join(work, f"server-{'on' if capture else 'off'}.log"),
                 ["--chunked-prefill-size", "512", "--disable-radix-cache", "--skip-server-warmup"])
    try:
        srv.wait_healthy()
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "hs_capture.cli", "send", data, "--url", srv.url,
                              "-c", str(concurrency), "--json", "--failures", os.path.join(work, "f.jsonl")],
                             capture_output=True, text=True, cwd=REPO, timeout=1800)
        wall = time.perf_counter() - t0
        summary = json.loads(out.stdout)
        assert summary["sent"] > 0 and summary["failed"] == 0, out.stderr[-2000:]
    finally:
        srv.stop()
    disk = sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(dump) for n in ns) if capture else 0
    return {"capture": capture, "wall_s": round(wall, 3), "prefill_tokens_per_s": round(tokens / wall, 1),
            "dump_bytes": disk}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--samples", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the capture server (e.g. HSCAP_FSYNC=0)")
    p.add_argument("--both-env", action="append", default=[], help="KEY=VALUE for both servers (e.g. OMP_NUM_THREADS=1)")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "e2e_overhead.cpu2.results.json"))
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="hscap-e2e-bench-")
    try:
        model = make_tiny_deepseek(os.path.join(work, "model"), layers=6)
        data = os.path.join(work, "data.jsonl")
        tokens = dataset(data, a.samples)
        extra = dict(kv.split("=", 1) for kv in a.env)
        both = dict(kv.split("=", 1) for kv in a.both_env)
        rounds = []
        for r in range(a.rounds):
            for capture in (False, True):
                res = one_round(model, data, tokens, capture, work, a.concurrency, extra, both)
                rounds.append(res)
                print(json.dumps(res), flush=True)
        off = statistics.median(x["prefill_tokens_per_s"] for x in rounds if not x["capture"])
        on = statistics.median(x["prefill_tokens_per_s"] for x in rounds if x["capture"])
        result = {
            "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} {os.cpu_count()} cpus, no GPU",
            "what": f"real sglang CPU server, tiny DeepSeek-V3 (6 layers, hidden 256, float32), {a.samples} "
                    f"samples 64..1023 tokens ({tokens} tokens), concurrency {a.concurrency}, chunked prefill 512, "
                    f"capture of layers 1,3,5 + final, {extra.get('HSCAP_CODEC', 'bytegroup')} level "
                    f"{extra.get('HSCAP_LEVEL', '1')}, writer threads {extra.get('HSCAP_WRITER_THREADS', 'auto')}",
            "tokens_per_s_off_median": off, "tokens_per_s_on_median": on,
            "capture_env": extra, "both_env": both, "ratio_on_over_off": round(on / off, 4), "rounds": rounds,
        }
        print(f"prefill tokens/s: capture off {off:.0f}, on {on:.0f}: on/off = {on / off:.3f}")
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
