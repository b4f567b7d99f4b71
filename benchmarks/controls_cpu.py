"""Do gpu/purpose.py's controls separate from the right drafter, and would another language
separate them further? A check on the CPU, before GPU time is spent on it.

For each language: the CPU-sized target of gpu/lib/language.py (the same DeepSeek-V3 shape, smaller)
trained with transformers; its states from transformers' own forward (hidden_states[i] enters
layer i: the hook's convention); an EAGLE-3-shaped drafter (fc of three states + the next
token's frozen target embedding, one causal attention + MLP layer, a head started from the
target's) trained on each control's states, then judged on the RIGHT held-out states (the
no-states baseline on zeros) by top-1 agreement with the target's next token, as SpecForge's evaluator judges purpose.py's drafters.
The drafter is this file's own, not SpecForge's: the check is of the data's design.

  right       layers 2,3,5
  wrong       layers 1,2,4 (one below each: an off-by-one layer id)
  shifted     2,3,5 and the final state one token late, as purpose.py's shift_one_token moves
              them (SpecForge's targets come from the final state: the labels move too)
  permuted    the layers concatenated as 5,2,3
  tokens_only not one of purpose.py's: no states at all (zeros, in training and judging), the
              baseline of what the tokens alone give

Languages: `phrases` (language.py's: each phrase followed by one of 3 successors, weights
0.6/0.3/0.1) and `second_order` (the successor chosen by the phrase before the current one, 9
times in 10: what the target's states carry and the current token does not).

usage: python benchmarks/controls_cpu.py [--languages phrases second_order] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "gpu", "lib"))
sys.path.insert(0, os.path.dirname(HERE))
import language  # noqa: E402
from tests.sglang_cpu.models import fix_routing  # noqa: E402

CONTROLS = {"right": [2, 3, 5], "wrong": [1, 2, 4], "shifted": [2, 3, 5], "permuted": [5, 2, 3], "tokens_only": None}
SKIP = 8  # a text's first positions cannot know their phrase (language.evaluate leaves them out too)


class SecondOrder(language.Grammar):
    """The phrase after the current one is chosen by the one before it (FOLLOW of the time)."""
    FOLLOW = 0.9

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        rng = random.Random(seed + 7)
        self.choice = [rng.randrange(len(language.SUCCESSOR_WEIGHTS)) for _ in range(language.PHRASES)]

    def text(self, rng: random.Random, length: int) -> List[int]:
        out: List[int] = []
        prev, p = rng.randrange(language.PHRASES), rng.randrange(language.PHRASES)
        while len(out) < length:
            out.extend(self.phrases[p])
            i = self.choice[prev] if rng.random() < self.FOLLOW else rng.randrange(len(self.successors[p]))
            prev, p = p, self.successors[p][i]
        return out[:length]


LANGUAGES = {"phrases": language.Grammar, "second_order": SecondOrder}


def texts(grammar, seed: int, n: int, length: int) -> torch.Tensor:
    rng = random.Random(seed)
    return torch.tensor([grammar.text(rng, length) for _ in range(n)])


def train_target(grammar, steps: int, batch: int, length: int, lr: float = 2e-3):
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(language._config("cpu"))
    fix_routing(model, torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    rng = random.Random(1)
    for step in range(steps):
        x = torch.tensor([grammar.text(rng, length) for _ in range(batch)])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return model.eval()


@torch.no_grad()
def forward(model, x: torch.Tensor, chunk: int = 64):
    """(hidden states [layer, text, position, hidden], the target's greedy next tokens)."""
    states, greedy = [], []
    for i in range(0, len(x), chunk):
        out = model(input_ids=x[i:i + chunk], output_hidden_states=True)
        states.append(torch.stack(out.hidden_states[:-1]))
        greedy.append(out.logits.argmax(-1))
    return torch.cat(states, 1), torch.cat(greedy)


class RMSNorm(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(h))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


class Drafter(nn.Module):
    """EAGLE-3's first draft step: fc(3 states) beside the next token's embedding, one layer."""

    def __init__(self, target, heads: int = 4) -> None:
        super().__init__()
        h, self.heads = target.config.hidden_size, heads
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.embed = nn.Embedding.from_pretrained(target.model.embed_tokens.weight.detach().clone(), freeze=True)
        self.norm_e, self.norm_h, self.norm_mlp, self.norm_out = RMSNorm(h), RMSNorm(h), RMSNorm(h), RMSNorm(h)
        self.qkv = nn.Linear(2 * h, 3 * h, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.up, self.down = nn.Linear(h, 4 * h, bias=False), nn.Linear(4 * h, h, bias=False)
        self.head = nn.Linear(h, target.config.vocab_size, bias=False)
        self.head.weight.data.copy_(target.lm_head.weight.detach())

    def forward(self, states: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        b, t, _ = states.shape
        h = self.fc(states)
        x = torch.cat([self.norm_e(self.embed(next_tokens)), self.norm_h(h)], -1)
        d = h.shape[-1] // self.heads
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        angle = torch.arange(t, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(0, d, 2).float() / d)
        cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
        rotate = lambda z: torch.cat([-z[..., d // 2:], z[..., :d // 2]], -1)  # noqa: E731
        q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        y = h + self.o(a)
        y = y + self.down(F.silu(self.up(self.norm_mlp(y))))
        return self.head(self.norm_out(y))


def control_states(states: torch.Tensor, name: str) -> torch.Tensor:
    layers = CONTROLS[name] or CONTROLS["right"]
    s = torch.cat([states[i] for i in layers], -1)
    if name == "shifted":
        s = torch.cat([s[:, :1], s[:, :-1]], 1)
    return torch.zeros_like(s) if name == "tokens_only" else s


def control_labels(greedy: torch.Tensor, name: str) -> torch.Tensor:
    """The target's next tokens a control trains on: one token late where its states are."""
    return torch.cat([greedy[:, :1], greedy[:, :-1]], 1) if name == "shifted" else greedy


def drafter_top1(target, x_tr, s_tr, g_tr, x_te, s_te, g_te, epochs: int = 6, batch: int = 16,
                 lr: float = 1e-3) -> float:
    """Train on (states at t, token t+1) -> the target's greedy token after t+1; top-1 on held-out."""
    torch.manual_seed(0)
    d = Drafter(target)
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=lr)
    n = len(x_tr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * (n // batch), pct_start=0.05)
    order = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        perm = torch.randperm(n, generator=order)
        for i in range(0, n - batch + 1, batch):
            j = perm[i:i + batch]
            logits = d(s_tr[j][:, :-1], x_tr[j][:, 1:])[:, SKIP:]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), g_tr[j][:, 1:][:, SKIP:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    with torch.no_grad():
        hit = d(s_te[:, :-1], x_te[:, 1:]).argmax(-1) == g_te[:, 1:]
    return round(hit[:, SKIP:].float().mean().item(), 4)


def run(name: str, target_steps: int, n_train: int, n_heldout: int, length: int) -> Dict[str, object]:
    t0 = time.time()
    grammar = LANGUAGES[name](0)
    target = train_target(grammar, target_steps, 16, length)
    x_tr, x_te = texts(grammar, 5, n_train, length), texts(grammar, 6, n_heldout, length)
    s_tr, g_tr = forward(target, x_tr)
    s_te, g_te = forward(target, x_te)
    res: Dict[str, object] = {
        "target_greedy": round((g_te[:, :-1] == x_te[:, 1:])[:, SKIP:].float().mean().item(), 4)}
    right_te = control_states(s_te, "right")
    top1 = {}
    for control in CONTROLS:
        te = torch.zeros_like(right_te) if control == "tokens_only" else right_te
        top1[control] = drafter_top1(target, x_tr, control_states(s_tr, control), control_labels(g_tr, control),
                                     x_te, te, g_te)
        print(f"{name} {control}: {top1[control]}", flush=True)
    res["heldout_top1"] = top1
    miss = 1 - top1["right"]
    res["misses_over_right"] = {k: round((1 - v) / miss, 2) for k, v in top1.items() if k != "right" and miss > 0}
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--languages", nargs="+", default=list(LANGUAGES), choices=list(LANGUAGES))
    ap.add_argument("--target-steps", type=int, default=400)
    ap.add_argument("--train", type=int, default=512, help="training texts")
    ap.add_argument("--heldout", type=int, default=64)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    res = {"what": "purpose.py's controls on the CPU: an EAGLE-3-shaped drafter of this file trained on each "
                   "control's states of a CPU-sized target, judged on the right held-out states; benchmarks/controls_cpu.py",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "settings": {"target_steps": a.target_steps, "train_texts": a.train, "heldout_texts": a.heldout,
                        "length": a.length, "target_size": language.SIZES["cpu"]},
           "languages": {name: run(name, a.target_steps, a.train, a.heldout, a.length) for name in a.languages}}
    print(json.dumps(res, indent=1))
    if a.out:
        with open(a.out + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
    main()
