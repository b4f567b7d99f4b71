"""The SGLang classes hs_capture patches: one small registry, one entry per model family.

Every family here has SGLang's own EAGLE-3 capture (`set_eagle3_layers_to_capture`):
its Model's forward returns `(hidden, aux)` once told which layers to capture, with
index i = the residual stream entering decoder layer i. Families differ only in how the
Model is told (`select`):

- "list": the forward reads `model.layers_to_capture` (DeepSeek, Llama, Qwen2/3).
- "layer_flags": the forward reads `_is_layer_to_capture` on each decoder layer; the
  list is bookkeeping only (Qwen2-MoE/Qwen3-MoE).

Subclasses that inherit the wrapped methods (DeepseekV3ForCausalLM for Kimi-K2,
DeepseekV32, MistralLarge3, GlmMoeDsa) and wrappers that hold one
(KimiK25ForConditionalGeneration.language_model) are covered by patching the class that
defines the method, which may live in another module (Qwen3Model.forward is
Qwen2Model's up to 0.5.15).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

LIST, LAYER_FLAGS = "list", "layer_flags"


@dataclass(frozen=True)
class Target:
    family: str
    module: str        # the submodule that defines the classes (post-import hooks key on it)
    causal_lm: str     # its __init__ turns capture on
    model: str         # its forward hands over the captures
    select: str = LIST  # how the Model is told which layers to capture (see above)


TARGETS: Tuple[Target, ...] = (
    Target("deepseek", "sglang.srt.models.deepseek_v2", "DeepseekV2ForCausalLM", "DeepseekV2Model"),
    Target("llama", "sglang.srt.models.llama", "LlamaForCausalLM", "LlamaModel"),
    Target("qwen3", "sglang.srt.models.qwen3", "Qwen3ForCausalLM", "Qwen3Model"),
    Target("qwen3_moe", "sglang.srt.models.qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeModel", LAYER_FLAGS),
)


@dataclass(frozen=True)
class RequestTarget:
    module: str
    cls: str  # its __init__ is where the capture policy judges a request (requests.py)


REQUESTS = RequestTarget("sglang.srt.managers.schedule_batch", "Req")


@dataclass(frozen=True)
class Covered:
    """An architecture (config.json) captured through a target without being its class."""
    architecture: str
    module: str
    family: str
    how: str


COVERED: Tuple[Covered, ...] = (
    Covered("DeepseekV3ForCausalLM", "sglang.srt.models.deepseek_v2", "deepseek", "subclass (Kimi-K2)"),
    Covered("DeepseekV32ForCausalLM", "sglang.srt.models.deepseek_v2", "deepseek", "subclass"),
    Covered("KimiK25ForConditionalGeneration", "sglang.srt.models.kimi_k25", "deepseek",
            "holds a DeepseekV3ForCausalLM as language_model"),
)


def for_architecture(arch: str) -> Optional[Target]:
    """The target that captures a model of this architecture, or None."""
    family = next((c.family for c in COVERED if c.architecture == arch), None)
    return next((t for t in TARGETS if t.causal_lm == arch or t.family == family), None)


def checkpoint_config(model_path: object) -> Optional[dict]:
    """A local checkpoint's config.json; None when there is no readable one (a hub id, say)."""
    try:
        with open(os.path.join(str(model_path), "config.json")) as f:
            body = json.load(f)
    except Exception:
        return None
    return body if isinstance(body, dict) else None


def checkpoint_architectures(model_path: object) -> Optional[List[str]]:
    """The architectures a local checkpoint's config.json names; None when there is no
    readable one (a hub id, say)."""
    body = checkpoint_config(model_path)
    if body is None:
        return None
    try:
        return [str(a) for a in body.get("architectures") or []]
    except Exception:
        return None
