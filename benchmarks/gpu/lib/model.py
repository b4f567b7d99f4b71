"""The GPU runner's model and loads: a random-weight DeepSeek-V3-shaped model (bf16), made on
the GPU with the machine's own transformers in seconds, and the request datasets.

MoE routing is made unambiguous: bf16 and float32 would otherwise pick different experts on
near-ties, and the capture's fidelity, not tie-breaking, is what is compared. Shape rules of
sglang 0.5.15's Triton MLA backend: kv_lora_rank 512 + rope 64 (its decode kernel handles K/V
head width 576 or 288 only); 24 routed experts (not a power of two: keeps flashinfer's JIT
top-k kernel, whose data the bundle leaves out, off).

usage: python benchmarks/gpu/lib/model.py MODEL_DIR DATA_DIR [--timed N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import time

E, K = 24, 8  # routed experts, experts per token
VOCAB = 32000


def make_model(out: str) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    t0 = time.time()
    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=2048, intermediate_size=8192, moe_intermediate_size=1024,
        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_shared_experts=1, n_routed_experts=E, num_experts_per_tok=K, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, num_nextn_predict_layers=0, topk_method="noaux_tc",
        scoring_func="sigmoid", moe_layer_freq=1)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).eval()
    g = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                # distinct per-layer biases 2 apart: scores are in (0, 1), so each layer's top-8 is
                # fixed whatever the token; the routing weights stay the token's own sigmoid scores
                t.copy_((2.0 * torch.randperm(E, generator=g)).to(t.dtype))
    model.config.architectures = ["DeepseekV3ForCausalLM"]
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    with open(os.path.join(tmp, "config.json")) as f:
        c = json.load(f)
    c["torch_dtype"] = "bfloat16"
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(c, f, indent=2)
    os.replace(tmp, out)
    n = sum(p.numel() for p in model.parameters())
    print(f"model {out}: {n / 1e9:.2f}B params, made in {time.time() - t0:.1f}s", flush=True)


def write_dataset(path: str, prefix: str, n: int, seed: int, lo: int, hi: int) -> None:
    rng = random.Random(seed)
    with open(path + ".tmp", "w") as f:
        for i in range(n):
            length = rng.randint(lo, hi)
            f.write(json.dumps({"id": f"{prefix}-{i}", "input_ids": [rng.randrange(2, VOCAB) for _ in range(length)]})
                    + "\n")
    os.replace(path + ".tmp", path)


def make_datasets(data: str, timed: int) -> None:
    os.makedirs(data, exist_ok=True)
    for tag, seed in (("off", 100), ("on", 101)):
        write_dataset(os.path.join(data, f"warm_{tag}.jsonl"), f"warm{tag}", 48, seed, 512, 2048)
    # the same timed prefill load for every server; decode traffic beside it (max_new_tokens 64)
    write_dataset(os.path.join(data, "timed.jsonl"), "t", timed, 7, 512, 2048)
    write_dataset(os.path.join(data, "decode.jsonl"), "d", 256, 8, 64, 256)
    print(f"datasets in {data}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("data_dir")
    ap.add_argument("--timed", type=int, default=1536, help="prompts in the timed load (512-2048 tokens each)")
    a = ap.parse_args()
    make_datasets(a.data_dir, a.timed)
    if not os.path.exists(os.path.join(a.model_dir, "config.json")):
        make_model(a.model_dir)


if __name__ == "__main__":
    main()
