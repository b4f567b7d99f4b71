"""The target's routed experts quantized the way Kimi-K2.5 ships them: compressed-tensors
`pack-quantized`, int4 weights, symmetric, one bf16 scale per group of 32 inputs (W4A16);
attention, shared experts, dense MLPs and the head stay bf16 (the release's `ignore` list).

Writes OUT (the Kimi-K2.5 wrapper checkpoint with the packed experts, what the server loads)
and OUT/text_model: the same model with every expert weight dequantized (q * scale, float32),
which transformers reads as the reference of the quantized server's states.

usage: python benchmarks/gpu/lib/int4.py MODEL_DIR OUT
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from typing import Dict, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(HERE))))
from tests.sglang_cpu.models import wrap_kimi_k25  # noqa: E402

GROUP = 32
EXPERT = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": GROUP, "dynamic": False, "actorder": None,
                                              "observer": "minmax", "observer_kwargs": {}}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None,
}


def quantize(w) -> Tuple[object, object, object]:
    """(packed int32 [out, in/8], scale bf16 [out, in/GROUP], dequantized float32 [out, in])."""
    import torch

    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // GROUP, GROUP)
    scale = (g.abs().amax(-1, keepdim=True) / 7.0).clamp_min(1e-8).to(torch.bfloat16)
    q = torch.round(g / scale.float()).clamp(-8, 7)
    deq = (q * scale.float()).reshape(out_f, in_f)
    u = (q.reshape(out_f, in_f // 8, 8).to(torch.int64) + 8)  # offset binary, 8 nibbles per int32
    packed = torch.zeros(out_f, in_f // 8, dtype=torch.int64)
    for i in range(8):
        packed |= u[:, :, i] << (4 * i)
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)
    return packed, scale.reshape(out_f, in_f // GROUP).contiguous(), deq


def main(model_dir: str, out: str) -> Dict[str, object]:
    import torch
    from safetensors.torch import load_file, save_file

    src = load_file(os.path.join(model_dir, "text_model", "model.safetensors"))
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    ref_dir = os.path.join(tmp, "text_model")
    os.makedirs(ref_dir)
    packed: Dict[str, object] = {}
    ref: Dict[str, object] = {}
    n, err = 0, 0.0
    for k, v in src.items():
        if EXPERT.match(k):
            p, s, deq = quantize(v)
            base = k[: -len(".weight")]
            packed.update({f"{base}.weight_packed": p, f"{base}.weight_scale": s,
                           f"{base}.weight_shape": torch.tensor(list(v.shape), dtype=torch.int64)})
            ref[k] = deq
            err = max(err, (deq - v.float()).abs().max().item())
            n += 1
        else:
            packed[k] = v
            ref[k] = v.float()
    save_file(ref, os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(model_dir, "text_model", "config.json")) as f:
        text_config = json.load(f)
    with open(os.path.join(ref_dir, "config.json"), "w") as f:
        json.dump({**text_config, "torch_dtype": "float32", "dtype": "float32"}, f, indent=2)
    for name in os.listdir(model_dir):  # the tokenizer and processor files
        if name not in ("model.safetensors", "config.json", "text_model", "target_training.json") and \
                os.path.isfile(os.path.join(model_dir, name)):
            shutil.copy(os.path.join(model_dir, name), tmp)
    wrap_kimi_k25(tmp, "bfloat16")  # the wrapper's config and processor, language_model.* weights ...
    save_file({f"language_model.{k}": v for k, v in packed.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})  # ... which the packed experts replace
    with open(os.path.join(tmp, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = QUANTIZATION_CONFIG
    # the served text config is bf16 like the release (SGLang reads the dtype there, and a float32
    # one, which the reference beside it needs, would be served in float16)
    cfg["text_config"].update(torch_dtype="bfloat16", dtype="bfloat16")
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    res = {"expert_matrices_quantized": n, "group_size": GROUP, "max_abs_rounding": round(err, 5),
           "bytes": sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))}
    print(json.dumps(res), flush=True)
    return res


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
