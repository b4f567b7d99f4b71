#!/usr/bin/env python
"""The main job on the bundled tiny model: a REAL SGLang server on this CPU, started with
the capture hook, serves a tiny random DeepSeek-V3; hs_capture dumps its hidden states;
the dump is read back and compared with transformers.

usage: python bin/demo.py [--out out/demo] [--requests 12]
"""

import argparse
import os
import random
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.sglang_cpu.harness import Server, hf_hidden_states, make_tiny_deepseek, server_env  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out/demo")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--layers", default="1,3,5", help="HSCAP_LAYERS (entering-layer convention)")
    a = p.parse_args()
    out = os.path.abspath(a.out)
    dump = os.path.join(out, "dump")
    shutil.rmtree(dump, ignore_errors=True)
    os.makedirs(out, exist_ok=True)
    model = make_tiny_deepseek(os.path.join(out, "model"), layers=6)
    print(f"model: {model}\ndump:  {dump}\nserver log: {out}/server.log", flush=True)
    srv = Server(model, server_env(dump, HSCAP_LAYERS=a.layers), os.path.join(out, "server.log"),
                 ["--chunked-prefill-size", "128", "--disable-radix-cache"])
    rng = random.Random(0)
    reqs = {f"sample-{i}": [rng.randrange(2, 1000) for _ in range(rng.choice([1, 17, 64, 200, 450]))]
            for i in range(a.requests)}
    try:
        srv.wait_healthy()
        t0 = time.time()
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda kv: srv.generate(*kv), reqs.items()))
        print(f"sent {len(reqs)} requests, {sum(map(len, reqs.values()))} tokens in {time.time() - t0:.1f}s", flush=True)
    finally:
        srv.stop()
    print("".join(line + "\n" for line in srv.log().splitlines() if line.startswith("[HS_DUMP]")), end="")

    import numpy as np

    from hs_capture.assemble import Assembler, plan

    # what `hscap merge` reads: the one completeness rule, then the samples stitched from the steps
    p = plan([dump], {rid: len(ids) for rid, ids in reqs.items()})
    assert not p.incomplete, p.incomplete
    asm = Assembler(p)
    worst = 0.0
    for rid, ids in reqs.items():
        s = asm.sample(rid)
        ref = hf_hidden_states(model, ids)
        diffs = [np.abs(s.layers[k].numpy() - ref[k]).max() for k in s.layers]
        diffs.append(np.abs(s.final.numpy() - ref[-1]).max())
        worst = max(worst, float(max(diffs)))
        assert s.input_ids.tolist() == ids, rid
    print(f"{len(reqs)} samples stitched from {p.runs[0].path}\n"
          f"layers {sorted(s.layers)} + final: max |captured - transformers| = {worst:.2e} (float32)")
    return 0 if worst <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
