#!/usr/bin/env python
"""A tiny random DeepSeek-V3 (6 layers, hidden 256, vocabulary 1024, float32) made with
transformers, and a JSONL dataset for it: what docs/cpu.md "By hand on this CPU" serves.

Beside the weights it writes the two files a real checkpoint has and the trainers' own
commands look for: a tokenizer (word level: token i is the word `t<i>`, 0 and 1 are `<s>`
and `</s>`; speculators' prepare-data and ModelOpt's training load the target's tokenizer) and
`model.safetensors.index.json` (SpecForge reads its target head through it). Neither
changes what SGLang serves (--skip-tokenizer-init) or what transformers computes.

usage: python bin/tiny_model.py OUT_DIR [--data data.jsonl] [--samples 12]
"""

import argparse
import json
import os
import random
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.sglang_cpu.models import VOCAB, make_tiny  # noqa: E402


def add_checkpoint_files(model_dir: str) -> None:
    """The tokenizer and the weight index (idempotent)."""
    from safetensors import safe_open
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if not os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        vocab = {"<s>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}  # the config's bos 0, eos 1
        tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="</s>", bos_token="<s>", eos_token="</s>",
                                pad_token="</s>").save_pretrained(model_dir)
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
        with open(index, "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)


def write_dataset(path: str, samples: int, seed: int = 0) -> None:
    """`samples` rows {"id", "input_ids", "loss_mask"} of 1 to 450 tokens; the loss mask
    covers each sample's second half."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(samples):
            ids = [rng.randrange(2, 1000) for _ in range(rng.choice([1, 17, 64, 200, 450]))]
            mask = [int(j >= len(ids) // 2) for j in range(len(ids))]
            f.write(json.dumps({"id": f"sample-{i}", "input_ids": ids, "loss_mask": mask}) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the model directory (kept if already made)")
    p.add_argument("--data", help="also write a JSONL dataset here")
    p.add_argument("--samples", type=int, default=12)
    a = p.parse_args()
    model = make_tiny("deepseek_v3", os.path.abspath(a.out), layers=6)
    add_checkpoint_files(model)
    print(f"model: {model}")
    if a.data:
        write_dataset(a.data, a.samples)
        print(f"dataset: {a.data} ({a.samples} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
