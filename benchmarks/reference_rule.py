"""Is `hscap verify --reference`'s bf16 rule within bf16 noise, and still far from a fault?

On a bf16 dump of the real SGLang server and the model it served, each state of each sample is
recomputed by transformers in float32 (the truth), in bf16 with its default attention kernel
(sdpa: the noise the rule is built from) and in bf16 with the eager kernel: a second right bf16
implementation of the same model, which the rule must pass like the server. Beside them, faults
the rule must fail: one token's state taken from another sample, every state one token late,
each layer stored as the next one captured.

Two rules, each token's relative error over its limit (1.0 is the limit; worst token shown):
  rule     verify's (hs_capture/offline/verify/reference.py): 4x transformers' own error at that
           token or at its worst 1% of the state's tokens over every sample, and the state's
           median within 4x transformers' median
  pairing  the rule before: 4x transformers' own error at that token, floored at the sample's
           median alone

For the faults the figure is the least detectable case: over the samples, the smallest worst
ratio (one wrong token: the ratio at that token).

usage: python benchmarks/reference_rule.py --dump DUMP --model MODEL [--samples 64] [--device cpu]
       [--out benchmarks/reference_rule.results.json]
A CPU dump of a trained target: `benchmarks/gpu/purpose.py --target-size cpu --steps target,on`
(benchmarks/README.md, reference_rule.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Dict, List

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from hs_capture.offline.assemble import Assembler  # noqa: E402
from hs_capture.offline.planning import plan  # noqa: E402
from hs_capture.offline.verify.reference import (NOISE_FACTOR, Reference, _judge_noisy, _limits, _Noisy,  # noqa: E402
                                                 _row_rel)


def pairing(rel: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """The rule before: each token over 4x its own noise, floored at the sample's median."""
    return rel / (NOISE_FACTOR * np.maximum(noise, max(float(np.median(noise)), 2.0 ** -9)))


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
    eager = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16,
                                                 attn_implementation="eager").to(a.device).eval()
    rids = sorted(p.samples)[:a.samples]
    rng = random.Random(0)
    # per state, per sample: (stored-like candidate -> per-token rel error), and the noise
    rows: Dict[str, List[Dict[str, np.ndarray]]] = {}
    wrong_at: Dict[str, int] = {}
    samples = {rid: asm.sample(rid) for rid in rids}
    for i, rid in enumerate(rids):
        s = samples[rid]
        ids = s.input_ids.numpy()
        hs, _ = ref.states(ids, prenorm=False)
        low, _ = ref.states(ids, prenorm=False, dtype="bfloat16")
        with torch.no_grad():
            t = torch.as_tensor(ids, device=a.device)[None]
            eag = [h[0].float().cpu().numpy() for h in eager(t, output_hidden_states=True).hidden_states]
        layers = sorted(s.layers)
        n = ids.size
        row = wrong_at.setdefault(rid, rng.randrange(n // 2, n))
        # another sample long enough whose prefix differs there (the same prefix is the same state:
        # a served text and a generation from it share theirs)
        other = next(samples[o] for o in rids[i + 1:] + rids[:i] if samples[o].input_ids.numel() > row
                     and not np.array_equal(samples[o].input_ids.numpy()[:row + 1], ids[:row + 1]))
        for j, k in enumerate(layers):
            got = s.layers[k].float().numpy()
            want = hs[k]
            wrong_row = got.copy()
            wrong_row[row] = other.layers[k][row].float().numpy()
            cands = {"server": got, "transformers_eager": eag[k], "other_sample_token": wrong_row,
                     "shifted": np.roll(got, 1, axis=0)}
            if j + 1 < len(layers):
                cands["next_layer"] = s.layers[layers[j + 1]].float().numpy()
            rec = {c: _row_rel(v - want, want) for c, v in cands.items()}
            rec["noise"] = _row_rel(low[k] - want, want)
            rows.setdefault(f"layer {k}", []).append(rec)

    out: Dict[str, dict] = {}
    for state, recs in rows.items():
        noise = np.concatenate([r["noise"] for r in recs])
        st: Dict[str, dict] = {"tokens": int(noise.size),
                               "transformers_sdpa": {"median": float(np.median(noise)),
                                                     "q99": float(np.quantile(noise, 0.99)),
                                                     "max": float(noise.max())}}
        for cand in [c for c in recs[0] if c != "noise"]:
            have = [r for r in recs if cand in r]
            lim = _limits(_Noisy(state, "bfloat16", r[cand], r["noise"]) for r in have)[(state, "bfloat16")]
            rule = [float(_judge_noisy(_Noisy(state, "bfloat16", r[cand], r["noise"]), lim, {}).ratio.max())
                    for r in have]
            pair = [float(pairing(r[cand], r["noise"]).max()) for r in have]
            if cand == "other_sample_token":  # the wrong token's own ratio
                rid_rows = [wrong_at[rid] for rid in rids]
                rule = [float(_judge_noisy(_Noisy(state, "bfloat16", r[cand], r["noise"]), lim, {}).ratio[w])
                        for r, w in zip(have, rid_rows)]
                pair = [float(pairing(r[cand], r["noise"])[w]) for r, w in zip(have, rid_rows)]
            rel = np.concatenate([r[cand] for r in have])
            fault = cand not in ("server", "transformers_eager")
            st[cand] = {"median": float(np.median(rel)), "q99": float(np.quantile(rel, 0.99)),
                        "max": float(rel.max()), "median_vs_ref": round(lim.median_vs_ref, 3),
                        "rule_worst": round(min(rule) if fault else max(rule), 3),
                        "pairing_worst": round(min(pair) if fault else max(pair), 3),
                        "pairing_tokens_over": int(sum((pairing(r[cand], r["noise"]) > 1).sum() for r in have)),
                        # the worst token's error over transformers' own at that token
                        "over_own_token_max": round(float(max((r[cand] / np.maximum(r["noise"], 1e-12)).max()
                                                              for r in have)), 2)}
        out[state] = st
    res = {"command": "python benchmarks/reference_rule.py " + " ".join(sys.argv[1:]), "date": time.strftime("%Y-%m-%d"),
           "samples": len(rids), "device": a.device,
           "wall_s": round(time.time() - t0, 1), "states": out,
           "note": "rule_worst/pairing_worst: the worst token's error over its limit (1.0 is the limit); for the "
                   "faults, the smallest over the samples (the least detectable case)"}
    print(f"{'state':9s} {'candidate':20s} {'median':>8s} {'max':>8s} {'rule':>7s} {'pairing':>8s} over")
    for state, st in out.items():
        for cand, v in st.items():
            if isinstance(v, dict) and "rule_worst" in v:
                print(f"{state:9s} {cand:20s} {v['median']:8.4f} {v['max']:8.4f} {v['rule_worst']:7.2f} "
                      f"{v['pairing_worst']:8.2f} {v['pairing_tokens_over']}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
