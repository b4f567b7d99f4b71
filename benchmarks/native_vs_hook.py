"""sglang 0.5.23's own aux capture (`--enable-return-aux-hidden-states`, states in the JSON
response) vs the hook, on the REAL server on this CPU, the same seeded workload: prompts of
64..1023 tokens, chunked prefill 256, 4 in flight, one new token each. Three servers, started
in turn: off (neither), native (the flag, every request asks `return_hidden_states`), hook
(`hscap serve`, layers 1,2,3; the native side asks for the same three). Per side: prefill
tokens/s, bytes kept per prompt token (the JSON responses / the dump on disk), samples complete (native: the response holds a row per prompt
token; hook: `hscap verify --dataset`), and whether the final state is there.

usage: python benchmarks/native_vs_hook.py [--samples 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from e2e_overhead import dataset  # noqa: E402
from tests.sglang_cpu.harness import Server, make_tiny_deepseek, server_env  # noqa: E402

FLAGS = ["--chunked-prefill-size", "256", "--disable-radix-cache", "--skip-server-warmup"]
NATIVE = ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
          "--return-aux-hidden-state-layer-ids", "1", "2", "3"]
CONCURRENCY = 4


def post(url: str, row: dict, native: bool) -> bytes:
    body = {"input_ids": row["input_ids"], "rid": row["id"], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    if native:
        body["return_hidden_states"] = True
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.read()


def run(mode: str, model: str, rows: list, data: str, work: str) -> dict:
    dump = os.path.join(work, f"dump-{mode}")
    shutil.rmtree(dump, ignore_errors=True)
    env = server_env(None, hook=False)
    launcher = None
    flags = list(FLAGS)
    if mode == "native":
        flags += NATIVE
    if mode == "hook":  # the documented launcher (it adds --skip-server-warmup itself too)
        launcher = [sys.executable, "-m", "hs_capture.cli", "serve", "-d", dump, "--layers", "1,2,3", "--"]
    srv = Server(model, env, os.path.join(work, f"server-{mode}.log"), flags, launcher=launcher)
    tokens = sum(len(r["input_ids"]) for r in rows)
    try:
        srv.wait_healthy()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(CONCURRENCY) as ex:
            bodies = list(ex.map(lambda r: post(srv.url, r, mode == "native"), rows))
        wall = time.perf_counter() - t0
    finally:
        srv.stop()
    out = {"mode": mode, "wall_s": round(wall, 2), "prefill_tokens_per_s": round(tokens / wall, 1)}
    if mode == "native":
        whole = 0
        for r, b in zip(rows, bodies):
            hs = json.loads(b)["meta_info"].get("hidden_states") or [[]]
            whole += len(hs[0]) == len(r["input_ids"])
        size = sum(len(b) for b in bodies)
        out.update(bytes_per_token=round(size / tokens, 1), samples_complete=whole, final_state=False,
                   layers="1,2,3 as SGLang numbers them (entering layers 1, 2, 3)")
    elif mode == "hook":
        size = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(dump) for n in ns)
        v = subprocess.run([sys.executable, "-m", "hs_capture.cli", "verify", dump, "--dataset", data, "--json"],
                           capture_output=True, text=True, cwd=REPO)
        doc = json.loads(v.stdout.strip().splitlines()[-1])
        out.update(bytes_per_token=round(size / tokens, 1), samples_complete=doc["stats"]["samples_complete"],
                   final_state=True, layers="1,2,3 (entering) + final", verify_ok=doc["ok"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=32)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "native_vs_hook.cpu2.results.json"))
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="hscap-native-")
    try:
        model = make_tiny_deepseek(os.path.join(work, "model"), layers=6)
        data = os.path.join(work, "data.jsonl")
        tokens = dataset(data, a.samples)
        with open(data) as f:
            rows = [json.loads(line) for line in f]
        results = []
        for mode in ("off", "native", "hook"):
            r = run(mode, model, rows, data, work)
            results.append(r)
            print(json.dumps(r), flush=True)
        off = results[0]["prefill_tokens_per_s"]
        for r in results[1:]:
            r["throughput_vs_off"] = round(r["prefill_tokens_per_s"] / off, 3)
        doc = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()}, {os.cpu_count()} cpus",
               "workload": f"{a.samples} prompts, {tokens} tokens (64..1023 each), tiny DeepSeek-V3 (6 layers, "
                           f"H 256, float32), chunked prefill 256, {CONCURRENCY} in flight, 1 new token",
               "results": results}
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(json.dumps(doc, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
