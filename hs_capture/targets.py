"""The SGLang classes hs_capture patches: one entry per defining module.

Subclasses that inherit the wrapped methods (DeepseekV3ForCausalLM for Kimi-K2,
DeepseekV32, MistralLarge3, GlmMoeDsa) and wrappers that hold one
(KimiK25ForConditionalGeneration.language_model) are covered by patching the
class that defines the method.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    module: str        # the submodule that defines the classes (post-import hooks key on it)
    causal_lm: str     # its __init__ turns capture on
    model: str         # its forward hands over the captures


DEEPSEEK_V2 = Target("sglang.srt.models.deepseek_v2", "DeepseekV2ForCausalLM", "DeepseekV2Model")
TARGETS = (DEEPSEEK_V2,)
