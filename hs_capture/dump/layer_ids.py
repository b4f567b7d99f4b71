"""The layer ids a drafter must carry so that the engine SERVING it hands it the layers it
trained on.

hs_capture names a captured state by the decoder layer it enters (index i = transformers'
`hidden_states[i]`). A drafter names its layers in its config
(`eagle_config.eagle_aux_hidden_state_layer_ids`), and the serving engine turns those ids
into the layers it captures from the target by a rule of its own, per model family and
release, read from the engine's code:

- SGLang passes them to the target's `set_eagle3_layers_to_capture(ids)`, which sets
  `model.layers_to_capture` (entering-layer indices, as ours):
  - DeepSeek (V2/V3, Kimi-K2, Kimi-K2.5 through its `language_model`) from 0.5.13:
    `ids + 1` only when `ids[0] == 1`, else `ids` as they are (models/deepseek_v2.py);
    before 0.5.13 always `ids + 1`;
  - Llama, Qwen3, Qwen3-MoE (0.5.10 .. 0.5.23): always `ids + 1`.
- vLLM (speculators' drafters) collects the state entering layer `idx` for each `idx` in
  the ids (`if idx in self.aux_hidden_state_layers: aux.append(hidden_states + residual)`
  before layer `idx` runs): the ids as they are, every family.

A captured set no id list maps back to (DeepSeek from 0.5.13, first layer 1: ids starting
with 1 become 2.., ids starting with 0 stay 0..) cannot be served: `ServedIds.ids` is None
and `problem` says which first layer to pick. This module is pure logic: the server side
(a warning at capture time) and the offline side (merge's trainer settings) both use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from hs_capture.dump.schema import RankMeta

Ids = List[int]


def _plus_one(ids: Sequence[int]) -> Ids:
    return [i + 1 for i in ids]


def _plus_one_if_first_is_one(ids: Sequence[int]) -> Ids:
    return _plus_one(ids) if ids and ids[0] == 1 else list(ids)


def _as_is(ids: Sequence[int]) -> Ids:
    return list(ids)


@dataclass(frozen=True)
class Rule:
    """How one engine release turns a drafter's ids into the layers it captures."""
    engine: str
    releases: str  # the release range it holds for, as text (">=0.5.13", "all")
    says: str  # the rule in words, for messages
    apply: Callable[[Sequence[int]], Ids]


_PLUS_ONE = "adds 1 to every id"
_DEEPSEEK_NEW = "adds 1 to every id only when the first id is 1, else takes the ids as they are"
_AS_IS = "takes the ids as they are (the state entering each layer)"

# (family, first release the rule holds for, rule); a family's rules newest first
_SGLANG: Dict[str, Tuple[Tuple[Tuple[int, ...], Rule], ...]] = {
    "deepseek": (((0, 5, 13), Rule("sglang", ">=0.5.13", _DEEPSEEK_NEW, _plus_one_if_first_is_one)),
                 ((0,), Rule("sglang", "<0.5.13", _PLUS_ONE, _plus_one))),
}
_SGLANG_DEFAULT = Rule("sglang", "all", _PLUS_ONE, _plus_one)  # llama, qwen3, qwen3_moe and the rest
VLLM = Rule("vllm", "all", _AS_IS, _as_is)

# Dumps written before the run metadata named its family: their architectures say it.
_ARCH_FAMILY = (("Deepseek", "deepseek"), ("KimiK2", "deepseek"), ("KimiVL", "deepseek"), ("Qwen3Moe", "qwen3_moe"),
                ("Qwen3", "qwen3"), ("Llama", "llama"))


def release(version: Optional[str]) -> Optional[Tuple[int, ...]]:
    """(0, 5, 23) from "0.5.23", "0.5.23rc1", "0.5.15.post1"; None when unreadable."""
    m = re.match(r"(\d+(?:\.\d+)*)", version or "")
    return tuple(int(x) for x in m.group(1).split(".")) if m else None


def sglang_rules(family: Optional[str]) -> List[Rule]:
    """Every SGLang rule for this family, newest release first."""
    return [r for _, r in _SGLANG[family]] if family in _SGLANG else [_SGLANG_DEFAULT]


def sglang_rule(family: Optional[str], version: Optional[str]) -> Rule:
    """The rule of this SGLang release (the newest when the release is unknown)."""
    rel = release(version)
    for since, rule in _SGLANG.get(family or "", ()):
        if rel is None or rel >= since:
            return rule
    return _SGLANG_DEFAULT


def ids_for(layers: Sequence[int], rule: Rule) -> Optional[Ids]:
    """The ids the rule maps onto exactly `layers` (in their order), or None. A layer's
    output (entering index - 1), the convention SGLang's drafts use, is tried first."""
    for ids in ([i - 1 for i in layers], list(layers)):
        if all(i >= 0 for i in ids) and rule.apply(ids) == list(layers):
            return ids
    return None


def family_of(meta: RankMeta) -> Optional[str]:
    """The model family a run's metadata names (older dumps: from its architectures)."""
    if meta.family:
        return meta.family
    for arch in list(meta.served_architectures) + list(meta.architectures):
        for prefix, family in _ARCH_FAMILY:
            if str(arch).startswith(prefix):
                return family
    return None


@dataclass
class ServedIds:
    """What a drafter trained on `layers` must carry to be served by `rule`."""
    layers: Ids
    family: Optional[str]
    rule: Rule
    ids: Optional[Ids]  # None: no id list is served on these layers
    # other releases of the engine that need other ids (release range -> ids or None)
    elsewhere: Dict[str, Optional[Ids]] = field(default_factory=dict)

    @property
    def engine(self) -> str:
        return f"{self.rule.engine} {self.rule.releases}" + (f" ({self.family})" if self.family else "")

    def problem(self) -> Optional[str]:
        """Why no drafter trained on these layers can be served, and what to capture instead."""
        if self.ids is not None:
            return None
        fix = ("capture with a first layer other than 1, e.g. 2 (SGLang's default layers are [2, N//2, N-3])"
               if self.layers and self.layers[0] == 1 else "capture other layers")
        return (f"{self.engine} cannot serve an EAGLE-3 drafter on the captured layers {self.layers}: its "
                f"set_eagle3_layers_to_capture {self.rule.says}, so no id list lands on them; {fix}")

    def note(self) -> Optional[str]:
        """Other releases that need other ids, when there are any."""
        if not self.elsewhere:
            return None
        other = "; ".join(f"{rel}: {ids if ids is not None else 'none (cannot be served)'}"
                          for rel, ids in self.elsewhere.items())
        return (f"these ids are for {self.engine}; a drafter served by another {self.rule.engine} release needs "
                f"other ids ({other})")

    def as_dict(self) -> Dict[str, object]:
        return {"engine": self.rule.engine, "releases": self.rule.releases, "family": self.family,
                "rule": self.rule.says, "ids": self.ids, "other_releases": dict(self.elsewhere)}


def served_ids(layers: Sequence[int], engine: str, family: Optional[str] = None,
               version: Optional[str] = None) -> ServedIds:
    """The ids for a drafter trained on `layers` served by `engine` ("sglang" or "vllm");
    `version`: the release assumed to serve it (None: the newest known)."""
    layers = list(layers)
    if engine == "vllm":
        return ServedIds(layers, family, VLLM, ids_for(layers, VLLM))
    rule = sglang_rule(family, version)
    result = ServedIds(layers, family, rule, ids_for(layers, rule))
    for other in sglang_rules(family):
        ids = ids_for(layers, other)
        if other is not rule and ids != result.ids:
            result.elsewhere[other.releases] = ids
    return result
