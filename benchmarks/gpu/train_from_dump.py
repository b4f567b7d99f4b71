"""SpecForge and speculators train straight from a dump on a machine with an NVIDIA GPU, beside
the same trainer on `hscap merge`'s output of the same dump, through each trainer's own command.

The fixture (benchmarks/gpu/lib/train_fixture.sh makes it with the real SGLang on a CPU): a tiny
random DeepSeek-V3 (model/), its dump captured in bfloat16 with layers 2,3,5 and the pre-norm
state (dump/), the JSONL sent (data.jsonl) and speculators' own prepared dataset of the same
samples, sent too (sp/). For each trainer: one run on merged files, one through `hscap train`
on the dump with no merged file on disk; the losses each logged, the wall time, the disk.

usage: python3 benchmarks/gpu/train_from_dump.py --fixture DIR --work DIR --out RESULTS.json [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

HSCAP = [sys.executable, "-m", "hs_capture.cli"]


def _run(name: str, cmd, log: str, cwd=None) -> dict:
    t0 = time.monotonic()
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, text=True)
    wall = round(time.monotonic() - t0, 1)
    text = open(log).read()
    print(f"== {name}: exit {p.returncode} in {wall} s", flush=True)
    print(text[-1500:], flush=True)
    return {"exit": p.returncode, "wall_s": wall, "log_tail": text[-600:], "text": text}


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _floats(pattern: str, text: str):
    return [float(x) for x in re.findall(pattern, text)]


def specforge(fx: str, work: str, steps: int) -> dict:
    sf = os.path.join(work, "sf")
    merge = _run("merge specforge", [*HSCAP, "merge", os.path.join(fx, "dump"), "-o", sf, "--format", "specforge",
                                     "--dataset", os.path.join(fx, "data.jsonl")], os.path.join(work, "merge-sf.log"))

    # a one-layer draft the size of the tiny target, its vocabulary smaller than the target's (the
    # map is counted from the data); the ids SGLang serves layers 2,3,5 on (merge's trainer_settings)
    draft = os.path.join(work, "draft.json")
    with open(draft, "w") as f:
        json.dump({"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 256,
                   "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 4,
                   "num_hidden_layers": 1, "vocab_size": 1024, "draft_vocab_size": 512,
                   "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "hidden_act": "silu", "pad_token_id": 0,
                   "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                   "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}, f)

    def config(data: str, tag: str) -> str:
        path = os.path.join(work, f"sf-{tag}.yaml")
        with open(path, "w") as f:
            f.write(f"""model:
  target_model_path: {fx}/model
  aux_hidden_state_layer_ids: [1, 2, 4]
  torch_dtype: bfloat16
  draft_model_config: {draft}
data:
  hidden_states_path: {data}
  cache_dir: {work}/sf-cache-{tag}
deployment:
  trainer:
    nproc_per_node: 1
training:
  batch_size: 1
  num_epochs: 4
  max_steps: {steps}
  log_interval: 1
  seed: 0
output_dir: {work}/sf-out-{tag}
""")
        return path

    runs = {"merged": _run("specforge on merged files", ["specforge", "train", "--config", config(sf, "merged")],
                           os.path.join(work, "sf-merged.log")),
            "dump": _run("specforge on the dump", [*HSCAP, "train", "specforge", "--dataset",
                                                   os.path.join(fx, "data.jsonl"), "--", "--config",
                                                   config(os.path.join(fx, "dump"), "dump")],
                         os.path.join(work, "sf-dump.log"))}
    return {"merge_exit": merge["exit"], "merged_gb": round(_du(sf) / 1e9, 4), "runs": _summary(runs)}


def speculators(fx: str, work: str, steps: int) -> dict:
    sp_merged = os.path.join(work, "sp-merged")
    shutil.copytree(os.path.join(fx, "sp"), sp_merged)
    merge = _run("merge speculators", [*HSCAP, "merge", os.path.join(fx, "dump"), "-o",
                                       os.path.join(sp_merged, "hidden_states"), "--format", "speculators",
                                       "--dataset", sp_merged], os.path.join(work, "merge-sp.log"))
    common = ["--verifier-name-or-path", os.path.join(fx, "model"), "--target-layer-ids", "2", "3", "5",
              "--max-steps", str(steps), "--log-freq", "1", "--epochs", "4", "--total-seq-len", "1024",
              "--hidden-states-dtype", "bfloat16", "--num-workers", "2",
              # its fused (Triton) loss fails under torch 2.11's compile on the merged files as on the dump
              "--loss-implementation", "eager"]
    runs = {"merged": _run("speculators on merged files",
                           ["speculators", "train", "--data-path", sp_merged, *common,
                            "--save-path", os.path.join(work, "sp-out-merged")], os.path.join(work, "sp-merged.log")),
            "dump": _run("speculators on the dump",
                         [*HSCAP, "train", "speculators", "--", "--data-path", os.path.join(fx, "sp"),
                          "--hidden-states-path", os.path.join(fx, "dump"), *common,
                          "--save-path", os.path.join(work, "sp-out-dump")], os.path.join(work, "sp-dump.log"))}
    return {"merge_exit": merge["exit"], "merged_gb": round(_du(os.path.join(sp_merged, "hidden_states")) / 1e9, 4),
            "runs": _summary(runs)}


def _summary(runs: dict) -> dict:
    out = {}
    for k, r in runs.items():
        text = r.pop("text")
        # the trainers' own log lines: SpecForge "loss=..."/"'loss': ...", speculators "loss: ..."
        losses = _floats(r"(?<![a-z_])loss['\"]?\s*[:=]\s*'?([0-9]+\.[0-9]+(?:e[-+]?[0-9]+)?)", text)
        out[k] = {**r, "losses": losses[:50]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixture", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--trainers", nargs="+", default=["specforge", "speculators"])
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    import torch

    result = {"what": "SpecForge 0.2.0 and speculators 0.9.0 train through their own commands, on merge's output "
                      "and straight from the dump (`hscap train`), same fixture, same settings",
              "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "torch": torch.__version__, "steps": a.steps, "dump_gb": round(_du(os.path.join(a.fixture, "dump")) / 1e9, 4),
              **{t: {"specforge": specforge, "speculators": speculators}[t](a.fixture, a.work, a.steps)
                 for t in a.trainers}}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
