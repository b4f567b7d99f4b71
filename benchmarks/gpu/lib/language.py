"""A seeded synthetic language, and a Kimi-K2.5-shaped target trained on it until its greedy
predictions are confident: a random model predicts nothing a drafter could learn.

The language: a lexicon of PHRASES fixed phrases of 3-8 tokens drawn from ALPHABET token ids;
each phrase is followed by one of 3 successor phrases (weights 0.6, 0.3, 0.1). A text walks that
chain. Inside a phrase the next token is fixed by the tokens before it; at a phrase's end the
best guess is right 60% of the time. So the best any model can do is known (`oracle`).

The target: KimiK25ForConditionalGeneration around a DeepSeek-V3 text model (MLA with
kv_lora_rank 512 + rope 64, MoE with a shared expert; 24 routed experts, 8 per token, router
biases 2 apart so each layer's top-8 is fixed and bf16 picks the experts float32 does), trained
with transformers, stored in bfloat16.

usage: python benchmarks/gpu/lib/language.py OUT_MODEL [--steps 600] [--size gpu|cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from typing import Dict, List, Sequence, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, REPO)
from tests.sglang_cpu.models import VOCAB, fix_routing, wrap_kimi_k25  # noqa: E402

PHRASES, ALPHABET, FIRST_ID = 160, 480, 2   # token ids 2..481, well inside the 1024 vocabulary
SUCCESSOR_WEIGHTS = (0.6, 0.3, 0.1)
E, K = 24, 8  # routed experts, experts per token

SIZES = {
    # the GPU target: ~0.1 B parameters, 6 layers; shapes sglang 0.5.15's Triton MLA backend serves
    "gpu": dict(hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256, num_hidden_layers=6,
                num_attention_heads=8, num_key_value_heads=8, q_lora_rank=768, kv_lora_rank=512,
                qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    # a CPU smoke test of this file
    "cpu": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64,
                qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
}


class Grammar:
    def __init__(self, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.phrases = [[rng.randrange(FIRST_ID, FIRST_ID + ALPHABET) for _ in range(rng.randint(3, 8))]
                        for _ in range(PHRASES)]
        self.successors = [rng.sample(range(PHRASES), len(SUCCESSOR_WEIGHTS)) for _ in range(PHRASES)]

    def text(self, rng: random.Random, length: int) -> List[int]:
        out: List[int] = []
        p = rng.randrange(PHRASES)
        while len(out) < length:
            out.extend(self.phrases[p])
            p = rng.choices(self.successors[p], SUCCESSOR_WEIGHTS)[0]
        return out[:length]

    def oracle(self, rng: random.Random, phrases: int = 20000) -> float:
        """The next-token accuracy of the best possible predictor over a long walk: every token
        inside a phrase is right; at a phrase's end, the likeliest next first token."""
        tokens, missed, p = 0, 0.0, rng.randrange(PHRASES)
        for _ in range(phrases):
            tokens += len(self.phrases[p])
            by_first: Dict[int, float] = {}
            for q, w in zip(self.successors[p], SUCCESSOR_WEIGHTS):
                by_first[self.phrases[q][0]] = by_first.get(self.phrases[q][0], 0.0) + w
            missed += 1.0 - max(by_first.values())
            p = rng.choices(self.successors[p], SUCCESSOR_WEIGHTS)[0]
        return 1.0 - missed / tokens


def write_jsonl(path: str, grammar: Grammar, prefix: str, n: int, lo: int, hi: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path + ".tmp", "w") as f:
        for i in range(n):
            ids = grammar.text(rng, rng.randint(lo, hi))
            # every token is trained on (speculators' prepare-data takes pre-tokenized rows with a mask)
            f.write(json.dumps({"id": f"{prefix}-{i}", "input_ids": ids, "loss_mask": [1] * len(ids)}) + "\n")
    os.replace(path + ".tmp", path)


def _config(size: str):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=VOCAB, **SIZES[size], n_shared_experts=1, n_routed_experts=E, num_experts_per_tok=K,
        n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=1, num_nextn_predict_layers=0, topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1)


def _batch(grammar: Grammar, rng: random.Random, n: int, length: int, device):
    import torch

    return torch.tensor([grammar.text(rng, length) for _ in range(n)], device=device)


def evaluate(model, grammar: Grammar, device, n: int = 64, length: int = 256, seed: int = 12345) -> Dict[str, float]:
    """Greedy next-token accuracy and mean top-1 probability on held-out texts."""
    import torch

    model.eval()
    x = _batch(grammar, random.Random(seed), n, length, device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=x).logits[:, :-1].float()
    p = logits.softmax(-1)
    hit = (logits.argmax(-1) == x[:, 1:]).float()
    # the first 8 positions of a text cannot know which phrase they are in: left out
    return {"greedy_accuracy": round(hit[:, 8:].mean().item(), 4),
            "mean_top1_prob": round(p.max(-1).values[:, 8:].mean().item(), 4)}


def train(out: str, steps: int, size: str, batch: int = 32, length: int = 256, lr: float = 2e-3,
          seed: int = 0) -> Dict[str, object]:
    """Train the target on the language; write OUT/text_model (bf16 DeepSeek-V3) and the
    Kimi-K2.5 wrapper checkpoint in OUT. Returns what was measured."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    grammar = Grammar(seed)
    torch.manual_seed(seed)
    t0 = time.time()
    model = DeepseekV3ForCausalLM(_config(size)).to(device)
    fix_routing(model, torch.Generator(device="cpu").manual_seed(1))
    before = evaluate(model, grammar, device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0,
                            betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=max(0.05, 3.0 / steps))
    rng = random.Random(seed + 1)
    losses: List[Tuple[int, float]] = []
    model.train()
    for step in range(steps):
        x = _batch(grammar, rng, batch, length, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            losses.append((step, round(loss.item(), 4)))
            print(f"target step {step} loss {loss.item():.4f}", flush=True)
    train_s = time.time() - t0
    after = evaluate(model, grammar, device)

    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    text = os.path.join(tmp, "text_model")
    model.config.architectures = ["DeepseekV3ForCausalLM"]
    model.to(torch.bfloat16).save_pretrained(text, safe_serialization=True)
    with open(os.path.join(text, "config.json")) as f:
        c = json.load(f)
    c["torch_dtype"] = "bfloat16"
    with open(os.path.join(text, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    stored = evaluate(model, grammar, device)  # the bf16 weights the server loads
    wrap_kimi_k25(tmp, "bfloat16")
    os.replace(tmp, out)
    res = {"language": f"seeded phrase grammar (seed {seed}): {PHRASES} phrases of 3-8 tokens over {ALPHABET} ids, "
                       f"3 successors each, weights {list(SUCCESSOR_WEIGHTS)}",
           "oracle_accuracy": round(grammar.oracle(random.Random(seed)), 4),
           "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
           "size": SIZES[size], "steps": steps, "batch": batch, "length": length, "lr": lr,
           "train_s": round(train_s, 1), "losses": losses, "before": before, "after": after,
           "after_bf16_weights": stored}
    with open(os.path.join(out, "target_training.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res), flush=True)
    return res


def main(argv: Sequence[str] = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--size", choices=sorted(SIZES), default="gpu")
    a = ap.parse_args(argv)
    train(a.out, a.steps, a.size)


if __name__ == "__main__":
    main()
