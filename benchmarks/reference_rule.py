"""Is `hscap verify --reference`'s bf16 rule within bf16 noise, and still far from a fault?

On a bf16 dump of the real SGLang server and the model it served, each state of each sample
(every captured layer, the pre-norm and the final state) is recomputed by transformers in
float32 (the truth), in bf16 with its default attention kernel (sdpa: the noise the rule is
built from) and in bf16 with the eager kernel: a second right bf16 implementation of the same
model, which the rule must pass like the server. Beside them, faults the rule must fail: one
token's state taken from another sample, every state one token late, each layer stored as the
next one captured.

Two rules:
  rule     verify's (hs_capture/offline/verify/reference.py): each token within 4x
           transformers' own error at that token (floored at the sample's median), but up to 1%
           of a sample's tokens (at least one) within 4x the level transformers' own worst 1%
           of the state's tokens reach
  pairing  the rule before: every token within 4x transformers' own error at that token,
           floored at the sample's median
Figures: samples failing, and the worst token's error over its bound (1.0 is the limit; for
the faults, the least detectable sample's). The rule pools the tail's level over the samples
compared: all of them here, 4 by default in verify, so it is also judged over random 4-sample
draws (`draws4_failing`: the share of draws with a finding).

usage: python benchmarks/reference_rule.py --dump DUMP --model MODEL [--samples 64] [--device cpu]
       [--out benchmarks/reference_rule.cpu2.results.json]
A CPU dump of a trained target: `benchmarks/gpu/purpose.py --target-size cpu --steps target,on`
(benchmarks/README.md, reference_rule.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from typing import Dict, List

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from hs_capture.offline.read.assemble import Assembler  # noqa: E402
from hs_capture.offline.read.planning import plan  # noqa: E402
from hs_capture.offline.verify.reference import Reference, _judge_noisy, _limits, _Noisy, _row_rel  # noqa: E402

RIGHT = ("server", "transformers_eager")
DRAWS = 200


def judge(recs: List[dict], cand: str, state: str, dtype: str) -> dict:
    """`cand` of the samples in recs under both rules, the tail's level pooled over them."""
    have = [r for r in recs if cand in r]
    noisy = [_Noisy(state, dtype, r[cand], r["noise"]) for r in have]
    lim = _limits(noisy)[(state, dtype)]
    judged = [_judge_noisy(n, lim, {}) for n in noisy]
    pair = [j.pairing for j in judged]  # the rule before: every token within its pairing
    if cand == "other_sample_token":  # the wrong token's own figure
        rule_w = [float(j.ratio[r["wrong_row"]]) for j, r in zip(judged, have)]
        pair_w = [float(p[r["wrong_row"]]) for p, r in zip(pair, have)]
    else:
        rule_w = [float(j.ratio.max()) for j in judged]
        pair_w = [float(p.max()) for p in pair]
    fault = cand not in RIGHT
    return {"samples": len(have), "rule_failing": sum(j.problem is not None for j in judged),
            "pairing_failing": sum(bool((p > 1).any()) for p in pair),
            "rule_worst": round(min(rule_w) if fault else max(rule_w), 3),
            "pairing_worst": round(min(pair_w) if fault else max(pair_w), 3),
            "tokens_over_pairing": int(sum((p > 1).sum() for p in pair)),
            "median_vs_ref": round(lim.median_vs_ref, 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True)
    ap.add_argument("--model", required=True, help="the served model (its text model for a multimodal wrapper)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out")
    a = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.time()
    p = plan([a.dump])
    asm = Assembler(p)
    ref = Reference(a.model, a.device)
    eager = copy.copy(ref)  # transformers' float32 model, with the eager-attention bf16 one as its bf16
    eager._low = {"bfloat16": AutoModelForCausalLM.from_pretrained(
        a.model, dtype=torch.bfloat16, attn_implementation="eager").to(a.device).eval()}
    rids = sorted(p.samples)[:a.samples]
    samples = {rid: asm.sample(rid) for rid in rids}
    dtypes = {str(s.final.dtype).replace("torch.", "") for s in samples.values()}
    if dtypes != {"bfloat16"}:
        sys.exit(f"reference_rule.py: the dump holds {sorted(dtypes)}, this measures bfloat16 dumps")
    rng = random.Random(0)
    rows: Dict[str, List[dict]] = {}  # state -> per sample: candidate -> per-token rel error, noise
    for i, rid in enumerate(rids):
        s = samples[rid]
        ids = s.input_ids.numpy()
        prenorm = s.prenorm is not None
        hs, pre = ref.states(ids, prenorm=prenorm)
        low, low_pre = ref.states(ids, prenorm=prenorm, dtype="bfloat16")
        eag, eag_pre = eager.states(ids, prenorm=prenorm, dtype="bfloat16")
        row = rng.randrange(ids.size // 2, ids.size)
        # another sample long enough whose prefix differs there (the same prefix is the same state:
        # a served text and a generation from it share theirs); none: no such fault for this one
        other = next((samples[o] for o in rids[i + 1:] + rids[:i] if samples[o].input_ids.numel() > row
                      and not np.array_equal(samples[o].input_ids.numpy()[:row + 1], ids[:row + 1])), None)
        layers = sorted(s.layers)
        states = [(f"layer {k}", s.layers[k], hs[k], low[k], eag[k],
                   other.layers[k] if other is not None else None,
                   s.layers[layers[j + 1]] if j + 1 < len(layers) else None) for j, k in enumerate(layers)]
        if prenorm:
            states.append(("final (pre-norm)", s.prenorm, pre, low_pre, eag_pre,
                           other.prenorm if other is not None else None, None))
        states.append(("final (post-norm)", s.final, hs[-1], low[-1], eag[-1],
                       other.final if other is not None else None, None))
        for state, stored, want, noise_of, eager_of, other_of, next_of in states:
            got = stored.float().numpy()
            cands = {"server": got, "transformers_eager": eager_of, "shifted": np.roll(got, 1, axis=0)}
            if other_of is not None:
                wrong = got.copy()
                wrong[row] = other_of[row].float().numpy()
                cands["other_sample_token"] = wrong
            if next_of is not None:
                cands["next_layer"] = next_of.float().numpy()
            rec = {c: _row_rel(v - want, want) for c, v in cands.items()}
            rec["noise"], rec["wrong_row"] = _row_rel(noise_of - want, want), row
            rows.setdefault(state, []).append(rec)

    out: Dict[str, dict] = {}
    draws = [rng.sample(range(len(rids)), min(4, len(rids))) for _ in range(DRAWS)]
    for state, recs in rows.items():
        noise = np.concatenate([r["noise"] for r in recs])
        st: Dict[str, dict] = {"tokens": int(noise.size),
                               "transformers_sdpa": {"median": float(np.median(noise)),
                                                     "q99": float(np.quantile(noise, 0.99)),
                                                     "max": float(noise.max())}}
        for cand in ("server", "transformers_eager", "other_sample_token", "shifted", "next_layer"):
            if not any(cand in r for r in recs):
                continue
            st[cand] = judge(recs, cand, state, "bfloat16")
            if cand in RIGHT:  # verify's default: the tail's level from 4 samples
                st[cand]["draws4_failing"] = round(sum(judge([recs[k] for k in d], cand, state, "bfloat16")
                                                       ["rule_failing"] > 0 for d in draws) / len(draws), 3)
        out[state] = st
    res = {"command": "python benchmarks/reference_rule.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
           "samples": len(rids), "device": a.device, "wall_s": round(time.time() - t0, 1), "states": out,
           "note": "rule_worst/pairing_worst: the worst token's error over its bound (1.0 is the limit); for the "
                   "faults, the least detectable sample's; *_failing: samples with a finding; draws4_failing: the "
                   f"share of {DRAWS} random 4-sample draws (verify's default) with a finding under the rule"}
    print(f"{'state':18s} {'candidate':19s} {'rule: failing/worst':>20s} {'pairing: failing/worst':>23s} draws4")
    for state, st in out.items():
        for cand, v in st.items():
            if isinstance(v, dict) and "rule_worst" in v:
                print(f"{state:18s} {cand:19s} {v['rule_failing']:>9d}/{v['samples']:<3d} {v['rule_worst']:6.2f} "
                      f"{v['pairing_failing']:>12d}/{v['samples']:<3d} {v['pairing_worst']:6.2f} "
                      f"{v.get('draws4_failing', '')}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
