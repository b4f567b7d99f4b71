#!/usr/bin/env python
"""The main job, end to end on this CPU, with the commands the README shows:

  1. a tiny random DeepSeek-V3 (6 layers) made with transformers, and a JSONL dataset;
  2. `hscap serve` (the launcher) starts the REAL SGLang server with capture on;
  3. `hscap send` feeds the dataset; the server is stopped (SIGTERM: the writer flushes);
  4. `hscap merge --format specforge` writes the training data (and the trainer settings);
  5. `hscap verify --dataset --reference` proves the dump whole and every captured state
     equal to transformers' float32 forward on the same weights (within 1e-4).

Ends on PASS or FAIL, with the threshold; exit 0 only on PASS.

usage: python bin/demo.py [--out out/demo] [--requests 12]
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.sglang_cpu.harness import Server, make_tiny_deepseek, server_env, write_jsonl  # noqa: E402

TOL = 1e-4  # float32 server vs transformers float32: the same arithmetic up to summation order


def hscap(*args: str) -> subprocess.CompletedProcess:
    """One `hscap` command, echoed as a user would type it."""
    print("$ hscap " + " ".join(args), flush=True)
    return subprocess.run([sys.executable, "-m", "hs_capture.cli", *args], cwd=REPO, capture_output=True, text=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/demo")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--layers", default="2,3,5", help="HSCAP_LAYERS (entering-layer convention; a first layer of 1 "
                   "cannot be served to a DeepSeek drafter by SGLang >= 0.5.13)")
    a = p.parse_args()
    out = os.path.abspath(a.out)
    dump, merged = os.path.join(out, "dump"), os.path.join(out, "specforge")
    for d in (dump, merged):
        shutil.rmtree(d, ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    model = make_tiny_deepseek(os.path.join(out, "model"), layers=6)
    rng = random.Random(0)
    rows = []
    for i in range(a.requests):
        ids = [rng.randrange(2, 1000) for _ in range(rng.choice([1, 17, 64, 200, 450]))]
        rows.append({"id": f"sample-{i}", "input_ids": ids, "loss_mask": [int(j >= len(ids) // 2) for j in range(len(ids))]})
    data = write_jsonl(os.path.join(out, "data.jsonl"), rows)
    print(f"model:   {model}\ndataset: {data} ({len(rows)} samples, {sum(len(r['input_ids']) for r in rows)} tokens)\n"
          f"dump:    {dump}\nserver log: {out}/server.log", flush=True)

    # 2. the launcher adds the flags capture needs (prefill graphs off, no radix cache, no warmup)
    print(f"$ hscap serve -d {dump} --layers {a.layers} -- --model-path {model} --device cpu ...", flush=True)
    srv = Server(model, server_env(None, hook=False), os.path.join(out, "server.log"), ["--chunked-prefill-size", "128"],
                 launcher=[sys.executable, "-m", "hs_capture.cli", "serve", "-d", dump, "--layers", a.layers, "--"])
    try:
        srv.wait_healthy()
        t0 = time.time()
        sent = hscap("send", data, "--url", srv.url, "-c", "4", "--failures", os.path.join(out, "failures.jsonl"))
        print(sent.stdout.strip() or sent.stderr.strip()[-2000:], f"({time.time() - t0:.1f} s)", flush=True)
    finally:
        srv.stop()
    print("".join(line + "\n" for line in srv.log().splitlines() if line.startswith("[HS_DUMP]")), end="")
    if sent.returncode != 0:
        print("FAIL: hscap send did not send every sample")
        return 1

    merge = hscap("merge", dump, "-o", merged, "--format", "specforge", "--dataset", data)
    print(merge.stderr.strip() + "\n" + merge.stdout.strip(), flush=True)
    verify = hscap("verify", dump, "--dataset", data, "--reference", model, "--reference-samples", str(len(rows)),
                   "--atol", str(TOL), "--rtol", "0", "--json")
    try:
        doc = json.loads(verify.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        print(verify.stdout[-2000:], verify.stderr[-2000:])
        print("FAIL: hscap verify gave no report")
        return 1
    st = doc.get("stats", {})
    whole = st.get("samples_complete")
    worst = st.get("reference_max_abs_diff")
    print(f"verify: {whole}/{len(rows)} samples whole; reference max |captured - transformers float32| = {worst}")
    ok = merge.returncode == 0 and verify.returncode == 0 and doc.get("ok") and whole == len(rows)
    if ok:
        print(f"PASS: every sample captured whole and merged; every captured state within {TOL:g} of transformers "
              f"(layers {a.layers} + the final state)")
        return 0
    for f in doc.get("findings", [])[:10]:
        print(f"  {f}")
    print(f"FAIL: see the findings above (threshold {TOL:g}, all {len(rows)} samples must be whole)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
