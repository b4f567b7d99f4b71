"""speculators with no glue: its own prepare step makes the dataset (shuffled rows, no ids),
`hscap send` feeds THAT dataset to the REAL CPU server, `hscap merge --format speculators
--dataset` writes where speculators reads (DATA/hidden_states/hs_<row>.safetensors), and
speculators' own ArrowDataset + CollateFn train-side data path reads every row back, in its
order, with its token ids and loss mask, and the states equal transformers'."""

import json
import os
import random

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from hs_capture.cli import main
from tests.sglang_cpu.harness import hf_hidden_states, serve_and_send, server_env

LAYERS = [1, 3, 5]
H = 256

datasets = pytest.importorskip("datasets")  # installed by bin/setup_env.sh with speculators


def word_level_tokenizer(path: str) -> str:
    """speculators' prepare step loads the target's processor even for pre-tokenized rows
    (to decode a sample for its log); the tiny model has none, so give it a word-level one."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(1000)}
    vocab["<eos>"] = 1000
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prepared(tiny_model, tmp_path_factory):
    from speculators.data_generation.preprocessing import load_and_preprocess_dataset

    root = tmp_path_factory.mktemp("spec")
    rng = random.Random(3)
    rows = []
    for n in [7, 40, 130, 3, 260, 64, 19, 90]:
        ids = [rng.randrange(2, 1000) for _ in range(n)]
        rows.append({"input_ids": ids, "loss_mask": [int(i >= n // 3) for i in range(n)]})
    raw = root / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds, _ = load_and_preprocess_dataset(word_level_tokenizer(str(root / "tok")), [str(raw)], seq_length=1024,
                                        build_dataset_num_proc=1, seed=0)
    data = str(root / "data")  # what `speculators prepare_data --output data` writes
    ds.save_to_disk(data)
    order = [r["input_ids"].tolist() for r in ds]
    assert sorted(map(tuple, order)) == sorted(tuple(r["input_ids"]) for r in rows)
    assert order != [r["input_ids"] for r in rows]  # prepare_data shuffled them: the row order is its own
    dump = str(root / "dump")
    serve_and_send(tiny_model, server_env(dump, HSCAP_LAYERS="1,3,5", HSCAP_PRENORM="1"), root,
                   ["--chunked-prefill-size", "64", "--disable-radix-cache"], data, len(rows), warmup=False)
    return {"data": data, "dump": dump, "rows": rows, "order": order}


def test_speculators_trains_on_the_merge_of_its_own_prepared_dataset(prepared, tiny_model):
    from speculators.train.data import ArrowDataset, CollateFn

    data = prepared["data"]
    res = CliRunner().invoke(main, ["merge", prepared["dump"], "-o", os.path.join(data, "hidden_states"),
                                    "--format", "speculators", "--dataset", data, "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output.strip().splitlines()[-1])
    assert summary["written"] == len(prepared["rows"]) and summary["settings"] == {"target_layer_ids": LAYERS}
    ds = ArrowDataset(max_len=1024, datapath=data, on_missing="raise")
    masks = {tuple(r["input_ids"]): r["loss_mask"] for r in prepared["rows"]}
    items = [ds[i] for i in range(len(ds))]
    for i, item in enumerate(items):
        ids = item["input_ids"].tolist()
        assert ids == prepared["order"][i]  # row i of speculators' own order (it checks token ids itself)
        assert item["loss_mask"].tolist() == masks[tuple(ids)]
        assert item["hidden_states"].shape == (len(ids), 3 * H) and item["hidden_states"].dtype == torch.float32
        ref, pre = hf_hidden_states(tiny_model, ids, prenorm=True)
        aux = np.concatenate([ref[k] for k in LAYERS], axis=-1)
        assert np.abs(item["hidden_states"].numpy() - aux).max() <= 1e-4
        assert np.abs(item["verifier_last_hidden_states"].numpy() - pre).max() <= 1e-4  # the pre-norm state
    batch = CollateFn(max_len=1024, hidden_size=H, dtype=torch.float32)(items[:3])
    assert batch["hidden_states"].shape[-1] == 3 * H and batch["input_ids"].shape[-1] == batch["loss_mask"].shape[-1]


def test_send_dry_run_reads_the_prepared_dataset_row_by_row(prepared):
    res = CliRunner().invoke(main, ["send", prepared["data"], "--dry-run", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output.strip().splitlines()[-1])
    assert summary["would_send"] == len(prepared["rows"])
    assert summary["tokens"] == sum(len(r["input_ids"]) for r in prepared["rows"])
