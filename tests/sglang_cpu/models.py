"""Tiny random checkpoints, one per model family hs_capture targets, made with transformers
so that transformers' float32 forward on the same files is the reference.

Every MoE routes each token to all of its experts: with top-k < n, a near-tie between two
experts' scores (1e-7 apart) is decided differently by SGLang and transformers now and then
(seen: 1 token of ~25k), and that token's state then differs by ~0.1. With all experts
chosen the MoE is a continuous weighting, and a comparison tests capture, not tie-breaking.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Dict

VOCAB = 1024
_COMMON = dict(vocab_size=VOCAB, hidden_size=256, num_attention_heads=4, rms_norm_eps=1e-6,
               tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
# SGLang's CPU rope factory asserts a yarn rope_scaling for MLA: DeepSeek-V3's own values
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
_MLA = dict(kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
            max_position_embeddings=163840, num_key_value_heads=4)


def _deepseek_v3(layers: int):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        **_COMMON, **_MLA, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=layers,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=8, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=_YARN,
        num_nextn_predict_layers=0, topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1)
    return DeepseekV3ForCausalLM(cfg), "DeepseekV3ForCausalLM"


def _deepseek_v2(layers: int):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        **_COMMON, **_MLA, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=layers,
        n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=8, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=1.0, norm_topk_prob=False, rope_parameters=_YARN,
        topk_method="greedy", scoring_func="softmax", moe_layer_freq=1)
    return DeepseekV2ForCausalLM(cfg), "DeepseekV2ForCausalLM"


def _llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**_COMMON, intermediate_size=512, num_hidden_layers=layers, num_key_value_heads=2,
                      max_position_embeddings=4096)
    return LlamaForCausalLM(cfg), "LlamaForCausalLM"


def _qwen3(layers: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**_COMMON, intermediate_size=512, num_hidden_layers=layers, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=4096)
    return Qwen3ForCausalLM(cfg), "Qwen3ForCausalLM"


def _qwen3_moe(layers: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**_COMMON, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=layers,
                         num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=8,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                         max_position_embeddings=4096)
    return Qwen3MoeForCausalLM(cfg), "Qwen3MoeForCausalLM"


BUILDERS: Dict[str, Callable] = {
    "deepseek_v3": _deepseek_v3, "deepseek_v2": _deepseek_v2, "llama": _llama,
    "qwen3": _qwen3, "qwen3_moe": _qwen3_moe,
}
FAMILIES = tuple(BUILDERS) + ("kimi_k25",)


def make_tiny(family: str, out: str, layers: int = 6, dtype: str = "float32", seed: int = 0,
              fixed_routing: bool = False) -> str:
    """Write a tiny random checkpoint of `family` to `out` (kept if already there).
    fixed_routing: router biases 2 apart, so every token's top-k is fixed per layer and a
    bf16 forward picks the experts a float32 one does (no near-ties to break differently)."""
    import torch

    if os.path.exists(os.path.join(out, "config.json")):
        return out
    if family == "kimi_k25":
        return _kimi_k25(out, layers, dtype, seed)
    torch.manual_seed(seed)
    model, arch = BUILDERS[family](layers)
    model = model.eval()
    if fixed_routing:
        fix_routing(model)
    else:
        with torch.no_grad():  # a non-zero router bias so noaux_tc routing is exercised
            for _, t in _router_biases(model):
                t.copy_(torch.randn_like(t) * 0.1)
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.config.architectures = [arch]
    model.to(getattr(torch, dtype)).save_pretrained(tmp, safe_serialization=True)
    _edit_config(tmp, lambda c: c.setdefault("torch_dtype", dtype))
    os.replace(tmp, out)  # a half-written model is never mistaken for a made one
    return out


def _router_biases(model):
    return [(n, t) for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if n.endswith("e_score_correction_bias")]


def fix_routing(model, generator=None) -> None:
    """Router biases 2 apart, never trained: scores are in (0, 1), so every token's top-k is fixed
    per layer and a bf16 forward picks the experts a float32 one does (the routing weights stay
    the token's own scores)."""
    import torch

    with torch.no_grad():
        for _, t in _router_biases(model):
            t.requires_grad_(False)
            t.copy_(2.0 * torch.randperm(t.numel(), generator=generator).to(t.dtype).reshape(t.shape))


def _edit_config(model_dir: str, edit: Callable[[dict], object]) -> None:
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        data = json.load(f)
    edit(data)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def _kimi_k25(out: str, layers: int, dtype: str, seed: int) -> str:
    """Kimi-K2.5's layout around a tiny random DeepSeek-V3 (wrap_kimi_k25)."""
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    make_tiny("deepseek_v3", os.path.join(tmp, "text_model"), layers, dtype, seed)
    wrap_kimi_k25(tmp, dtype)
    os.replace(tmp, out)
    return out


def wrap_kimi_k25(model_dir: str, dtype: str, vocab: int = VOCAB) -> None:
    """Kimi-K2.5's layout: a KimiK25ForConditionalGeneration config holding the DeepSeek-V3
    text_config of MODEL_DIR/text_model and a (tiny) MoonViT vision_config, text weights under
    `language_model.`. The text model stays beside it as a plain checkpoint: transformers has no
    Kimi-K2.5 class, and its text path is exactly that DeepSeek-V3."""
    from safetensors.torch import load_file, save_file

    text = os.path.join(model_dir, "text_model")
    with open(os.path.join(text, "config.json")) as f:
        text_config = json.load(f)
    weights = load_file(os.path.join(text, "model.safetensors"))
    save_file({f"language_model.{k}": v for k, v in weights.items()}, os.path.join(model_dir, "model.safetensors"),
              metadata={"format": "pt"})
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "torch_dtype": dtype, "text_config": text_config,
        # the vision tower is built but never run: text-only requests (its weights stay unset)
        "vision_config": {"patch_size": 14, "init_pos_emb_height": 8, "init_pos_emb_width": 8,
                          "init_pos_emb_time": 4, "num_attention_heads": 2, "num_hidden_layers": 1,
                          "hidden_size": 32, "intermediate_size": 64, "merge_kernel_size": [2, 2],
                          "vt_hidden_size": 32, "vt_num_hidden_layers": 1, "vt_num_attention_heads": 2,
                          "vt_intermediate_size": 64,  # the projector reads the vt_* names
                          "mm_hidden_size": 32, "text_hidden_size": text_config["hidden_size"]},
        "media_placeholder_token_id": vocab - 3, "pad_token_id": 0,
    }
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    _kimi_processor(model_dir, vocab)


def _kimi_processor(model_dir: str, vocab: int = VOCAB) -> None:
    """SGLang loads a multimodal model's processor even with --skip-tokenizer-init, and its
    Kimi-K2.5 processor wants Moonshot's remote-code one (media_processor): a word-level
    tokenizer plus the stand-in in remote_code/, loaded with --trust-remote-code."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab - 3)}
    words.update({"<|media_pad|>": vocab - 3, "<|kimi_k25_video_placeholder|>": vocab - 2, "<unk>": vocab - 1})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="t0", eos_token="t1",
                            pad_token="t0").save_pretrained(model_dir)
    name = "processing_tiny_kimi.py"
    shutil.copy(os.path.join(os.path.dirname(os.path.abspath(__file__)), "remote_code", name), model_dir)
    with open(os.path.join(model_dir, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "TinyKimiK25Processor",
                   "auto_map": {"AutoProcessor": "processing_tiny_kimi.TinyKimiK25Processor"}}, f, indent=2)


# Server flags a family needs on top of the CPU flags.
SERVER_FLAGS = {"kimi_k25": ("--trust-remote-code",)}


def reference_dir(model_dir: str) -> str:
    """The checkpoint transformers reads for `model_dir` (a wrapper's text model)."""
    text = os.path.join(model_dir, "text_model")
    return text if os.path.isdir(text) else model_dir
