"""The fidelity check for one (sglang release, model) pair: serve the tiny model with the
hook, send prompts that chunk and batch, stitch the dump, and compare every captured layer,
the final state and the pre-norm state with transformers' float32 forward.

Used by tests/test_versions.py (the suite's sglang, and other releases each in its own venv)
and by the matrix script (matrix.py)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import numpy as np

from hs_capture.offline.read.reader import open_runs
from tests.sglang_cpu.harness import Server, hf_hidden_states, server_env
from tests.sglang_cpu.stitch import stitch

CHUNK = 64
LENGTHS = (1, 5, 63, 64, 65, 150, 200, 33)  # around the chunk size; 150 and 200 take 3-4 chunks


@dataclass
class Fidelity:
    sglang: str
    architecture: str
    layers: List[int]
    samples: int
    max_diff: Dict[str, float] = field(default_factory=dict)  # "L03", "final", "prenorm"
    problems: List[str] = field(default_factory=list)
    log: str = ""

    @property
    def worst(self) -> float:
        return max(self.max_diff.values()) if self.max_diff else float("inf")


def run_fidelity(model_dir: str, workdir: str, num_layers: int, python: Optional[str] = None,
                 extra_flags: Sequence[str] = (), seed: int = 0, warmup: bool = True, **env: str) -> Fidelity:
    layers = list(range(1, num_layers))  # every layer the convention allows
    dump = os.path.join(workdir, "dump")
    srv = Server(model_dir, server_env(dump, HSCAP_LAYERS=",".join(map(str, layers)), HSCAP_PRENORM="1", **env),
                 os.path.join(workdir, "server.log"), ["--chunked-prefill-size", str(CHUNK), "--disable-radix-cache", *extra_flags],
                 python=python, warmup=warmup)
    rng = random.Random(seed)
    reqs = {f"fid-{i}": [rng.randrange(2, 1000) for _ in range(n)] for i, n in enumerate(LENGTHS)}
    try:
        srv.wait_healthy()
        with cf.ThreadPoolExecutor(4) as ex:  # concurrent: forwards hold several requests
            list(ex.map(lambda kv: srv.generate(*kv), reqs.items()))
    finally:
        srv.stop()
    log = srv.log()
    (run,) = open_runs(dump)
    archs = run.meta.served_architectures or run.meta.architectures
    result = Fidelity(run.meta.sglang_version or "?", ",".join(archs),
                      layers, 0, log=log)
    samples = stitch(run)
    for rid, ids in reqs.items():
        s = samples.get(rid)
        if s is None or not s.complete or s.input_ids.tolist() != ids:
            result.problems.append(f"{rid}: {'missing' if s is None else 'incomplete or wrong tokens'}")
            continue
        ref, pre = hf_hidden_states(model_dir, ids, prenorm=True)
        got = {f"L{i:02d}": (s.layers.get(i), ref[i]) for i in layers}
        got["final"] = (s.final, ref[-1])
        got["prenorm"] = (getattr(s, "prenorm", None), pre)
        for key, (mine, theirs) in got.items():
            if mine is None:
                result.problems.append(f"{rid}: no {key}")
                continue
            diff = float(np.abs(np.asarray(mine, dtype=np.float32) - theirs).max())
            result.max_diff[key] = max(result.max_diff.get(key, 0.0), diff)
        result.samples += 1
    return result
