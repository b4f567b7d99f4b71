"""Run in an sglang venv: what that release's own `set_eagle3_layers_to_capture` makes of
every list of drafter layer ids, per model family. Prints one JSON document:
{"sglang": version, "families": {family: [[ids, layers_to_capture], ...]}}.

The method is SGLang's own, called on an object that holds only what it reads (the pipeline
group, the config, the Model and its decoder layers), so no weights are built.
"""

from __future__ import annotations

import importlib
import itertools
import json
import sys
import types

# family -> (module, CausalLM class); Kimi-K2.5 hands the ids to its language_model
CLASSES = {
    "deepseek": ("sglang.srt.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("sglang.srt.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "llama": ("sglang.srt.models.llama", "LlamaForCausalLM"),
    "qwen3": ("sglang.srt.models.qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": ("sglang.srt.models.qwen3_moe", "Qwen3MoeForCausalLM"),
}
MODELS = {"qwen3_moe": ("sglang.srt.models.qwen3_moe", "Qwen3MoeModel")}


def _bare(cls_path, num_layers: int):
    module, name = cls_path
    cls = getattr(importlib.import_module(module), name)
    obj = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True),
                                config=types.SimpleNamespace(num_hidden_layers=num_layers),
                                capture_aux_hidden_states=False)
    return cls, obj


def layers_for(family: str, ids, num_layers: int):
    if family == "kimi_k25":
        kimi = getattr(importlib.import_module("sglang.srt.models.kimi_k25"), "KimiK25ForConditionalGeneration")
        inner_cls, inner = _bare(CLASSES["deepseek_v3"], num_layers)
        inner.model = types.SimpleNamespace(layers_to_capture=[])
        outer = types.SimpleNamespace(language_model=types.SimpleNamespace(
            set_eagle3_layers_to_capture=types.MethodType(inner_cls.set_eagle3_layers_to_capture, inner)))
        kimi.set_eagle3_layers_to_capture(outer, list(ids))
        return list(inner.model.layers_to_capture)
    cls, obj = _bare(CLASSES[family], num_layers)
    model = types.SimpleNamespace(layers_to_capture=[], layers=[types.SimpleNamespace() for _ in range(num_layers + 2)])
    if family in MODELS:
        mcls = getattr(importlib.import_module(MODELS[family][0]), MODELS[family][1])
        model.set_eagle3_layers_to_capture = types.MethodType(mcls.set_eagle3_layers_to_capture, model)
    obj.model = model
    cls.set_eagle3_layers_to_capture(obj, None if ids is None else list(ids))  # None: the release's default
    if family in MODELS:  # this family's forward reads the flags on each layer: they must agree
        flagged = [i for i, layer in enumerate(model.layers) if getattr(layer, "_is_layer_to_capture", False)]
        assert flagged == sorted(model.layers_to_capture), (flagged, model.layers_to_capture)
    return list(model.layers_to_capture)


def main() -> None:
    num_layers = int(sys.argv[1])
    import sglang

    out = {"sglang": sglang.__version__, "families": {}}
    for family in (*CLASSES, "kimi_k25"):
        out["families"][family] = [[list(ids), layers_for(family, ids, num_layers)]
                                   for k in (2, 3) for ids in itertools.permutations(range(num_layers), k)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
