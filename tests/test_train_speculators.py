"""speculators 0.9.0 trains straight from a dump (hs_capture/offline/train/trainers/speculators.py).

speculators' own prepared dataset of the served samples stays `--data-path`; its hidden states
come from the dump (`--hidden-states-path DUMP`) instead of `hscap merge --format speculators`'
hs_<row>.safetensors. With the patch, speculators' OWN loaders (create_train_val_loaders:
ArrowDataset, shift_batch, CollateFn, its multipack sampler reordered) over the dump give the
batches its same code gives over merge's files, in spawned workers and per data-parallel rank;
`hscap train speculators -- ...` runs its own `train` to where a CPU stops it, with the loaders
reading the dump, and its own draft model trains on a batch of them."""

import argparse
import itertools
import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from hs_capture.cli import main
from hs_capture.offline.train.trainers import speculators as sp

pytest.importorskip("speculators")
H = 256
SEQ = 1024


@pytest.fixture(scope="module")
def spec(served_dump, tiny_model, tmp_path_factory):
    """speculators' own prepared dataset of the dump's samples (it shuffles them and drops the
    1-token one), the JSONL of those samples in its row order (what `hscap train --dataset`
    names), merge's output for the same rows, and the target with the tokenizer it loads."""
    from speculators.data_generation.preprocessing import load_and_preprocess_dataset

    from tests.test_speculators_e2e import word_level_tokenizer

    root = tmp_path_factory.mktemp("sp-train")
    target = root / "target"
    target.mkdir()
    for name in os.listdir(tiny_model):
        os.symlink(os.path.join(tiny_model, name), target / name)
    word_level_tokenizer(str(target))
    raw = root / "raw.jsonl"
    raw.write_text("".join(json.dumps({"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]}) + "\n"
                           for r in served_dump["rows"]))
    ds, _ = load_and_preprocess_dataset(str(target), [str(raw)], seq_length=SEQ, build_dataset_num_proc=1, seed=0)
    data = str(root / "data")
    ds.save_to_disk(data)
    by_ids = {tuple(r["input_ids"]): r for r in served_dump["rows"]}
    order = [by_ids[tuple(r["input_ids"].tolist())] for r in ds]
    assert len(order) == len(served_dump["rows"]) - 1
    jsonl = root / "order.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in order))
    merged = os.path.join(data, "hidden_states")
    res = CliRunner().invoke(main, ["merge", served_dump["dir"], "-o", merged, "--format", "speculators",
                                    "--dataset", str(jsonl)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return {"data": data, "dump": served_dump["dir"], "merged": merged, "order": str(jsonl),
            "target": str(target), "rows": order, "root": root}


@pytest.fixture
def patched(spec):
    from speculators.train import dataloader
    from speculators.train.data import ArrowDataset

    before = dataloader.DataLoader, vars(ArrowDataset)["__init__"]
    inst = sp.SpeculatorsPatch()
    inst.instrument(spec["order"])
    yield inst
    inst.uninstrument()
    assert (dataloader.DataLoader, vars(ArrowDataset)["__init__"]) == before


def loaders(spec, hidden_states_path, num_workers=0, seed=3, total_seq_len=SEQ, train_data_ratio=0.75):
    """What speculators' train main builds: the file backend from its args, then its loaders."""
    from hs_connectors import HiddenStatesBackend
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import create_train_val_loaders

    transfer = HiddenStatesBackend.registry["file"].from_train_args(
        argparse.Namespace(hidden_states_path=hidden_states_path), spec["data"])
    return create_train_val_loaders(
        data_path=spec["data"], total_seq_len=total_seq_len, hidden_states_dtype=torch.float32, transfer=transfer,
        vllm_endpoint="http://127.0.0.1:9/v1", on_missing="raise", verifier_name_or_path=spec["target"],
        request_timeout=1.0, max_retries=0, generation_validation_retries=0, max_consecutive_generation_failures=1,
        hidden_size=H, num_target_layers=3, num_workers=num_workers, prefetch_factor=2, preprocess=shift_batch,
        train_data_ratio=train_data_ratio, seed=seed)


def same(a, b) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def merged_batch(loader, indices):
    """The same indices through the merged loader's own dataset and collator."""
    return loader.collate_fn([loader.dataset[int(i)] for i in indices])


def test_its_own_loaders_over_the_dump_give_the_batches_they_give_over_merged_files(spec, patched):
    from hs_connectors.transfer import FileTransfer
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    dump_loaders, merged_loaders = loaders(spec, spec["dump"]), loaders(spec, None)
    for dl, ml in zip(dump_loaders, merged_loaders):  # train, then val
        assert isinstance(dl.dataset.transfer, sp.DumpTransfer)
        # merge's files: speculators untouched
        assert type(ml.dataset.transfer) is FileTransfer and str(ml.dataset.transfer.hidden_states_path) == spec["merged"]
        assert type(ml.batch_sampler) is MultipackDistributedBatchSamplerV2 and "_generate_batches" not in vars(ml.batch_sampler)
        n = len(dl.dataset)
        for i in range(n):  # its per-item code (token-id check, the pre-norm state split off)
            same(dl.dataset[i], ml.dataset[i])
        lengths, orders = ml.batch_sampler.lengths, []
        for epoch in (0, 1):
            dl.batch_sampler.set_epoch(epoch)
            batches = [list(map(int, b)) for b in dl.batch_sampler]
            # an epoch reads every row of the split once, in batches within the token budget
            assert sorted(itertools.chain(*batches)) == list(range(n))
            assert all(sum(min(lengths[i], SEQ) for i in b) <= SEQ for b in batches)
            got = list(dl)
            assert len(got) == len(batches)
            for indices, batch in zip(batches, got):
                same(batch, merged_batch(ml, indices))
            orders.append(list(itertools.chain(*batches)))
        assert orders[0] != orders[1] or n < 4  # set_epoch reshuffles, as its own sampler's does


def test_spawned_workers_read_the_dump_each_a_contiguous_run_of_its_order(spec, patched):
    """speculators' DataLoader spawns its workers: the dump's transfer pickles into them (one
    worker here: each spawn imports speculators anew), and with 2 workers worker w (batches
    w, w+2, ...) reads one contiguous run of the dump sampler's order."""
    two, _ = loaders(spec, spec["dump"], num_workers=2)
    transfer, s = two.dataset.transfer, two.batch_sampler
    order = transfer.dump.sampler(seed=s.seed, rank=0, world_size=1)
    order.set_epoch(0)
    rows = [r for r in (transfer.row_at[i] for i in order) if r < len(two.dataset)]  # the train split's
    batches = [list(map(int, b)) for b in s]
    assert len(batches) >= 2
    assert list(itertools.chain(*batches[0::2], *batches[1::2])) == rows

    one, _ = loaders(spec, spec["dump"], num_workers=1)
    merged, _ = loaders(spec, None)
    batches = [list(map(int, b)) for b in one.batch_sampler]
    got = list(one)
    assert len(got) == len(batches)
    for indices, batch in zip(batches, got):
        same(batch, merged_batch(merged, indices))


def test_each_data_parallel_rank_reads_its_own_rows_and_all_step_together(spec, patched, monkeypatch):
    from speculators.train import dataloader

    monkeypatch.setattr(dataloader, "get_dp_size", lambda: 2)
    per_rank = []
    for rank in (0, 1):
        monkeypatch.setattr(dataloader, "get_dp_rank", lambda rank=rank: rank)
        train, _ = loaders(spec, spec["dump"])
        per_rank.append([list(map(int, b)) for b in train.batch_sampler])
    assert len(per_rank[0]) == len(per_rank[1]) >= 1  # every rank the same number of steps
    seen = [set(itertools.chain(*b)) for b in per_rank]
    assert seen[0] and seen[1] and not seen[0] & seen[1]


def test_without_the_dataset_that_was_sent_it_says_what_to_give(spec):
    from hs_capture.offline.read.reader import DumpError

    inst = sp.SpeculatorsPatch()
    inst.instrument(None)  # DATA's rows would be ids "0".."N-1"; the dump's are the JSONL's
    try:
        with pytest.raises(DumpError, match="holds none of the samples of .*hscap train --dataset"):
            loaders(spec, spec["dump"])
    finally:
        inst.uninstrument()


def test_a_row_the_dump_lacks_is_named_and_left_out(spec, tmp_path, caplog):
    rows = [dict(r) for r in spec["rows"]]
    rows[0]["id"] = "never-sent"
    jsonl = tmp_path / "order.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    inst = sp.SpeculatorsPatch()
    inst.instrument(str(jsonl))
    try:
        with caplog.at_level("WARNING", logger=sp.__name__):
            train, _ = loaders(spec, spec["dump"])
    finally:
        inst.uninstrument()
    n = len(train.dataset)
    assert f"1 of {n} rows (0..{n - 1}) of {spec['data']} are not whole in the dump" in caplog.text
    assert sorted(int(i) for b in train.batch_sampler for i in b) == list(range(1, n))


def test_hscap_train_runs_speculators_to_where_a_cpu_stops_it_and_its_model_trains_on_the_dump(spec, monkeypatch):
    """Its own `train` builds the draft and the loaders over the dump, then stops where its
    Trainer moves the draft to the GPU (README). The draft and loaders it built are kept
    (a spy around its Trainer) and one step is taken as its Trainer would, on the CPU."""
    import speculators.train.cli as train_cli

    built = {}
    real = train_cli.Trainer

    def trainer(model, config, train_loader, val_loader):
        built.update(model=model, config=config, train=train_loader)
        return real(model, config, train_loader, val_loader)

    monkeypatch.setattr(train_cli, "Trainer", trainer)
    args = ["--verifier-name-or-path", spec["target"], "--data-path", spec["data"],
            "--hidden-states-path", spec["dump"], "--target-layer-ids", "2", "3", "5",
            "--save-path", str(spec["root"] / "ckpt"), "--num-workers", "0", "--total-seq-len", "512",
            "--on-missing", "raise", "--hidden-states-dtype", "float32",
            # what a CPU can run backward through: sdpa, not flex attention; the loss without triton
            "--draft-attn-impl", "sdpa", "--loss-implementation", "eager"]
    res = CliRunner().invoke(main, ["train", "speculators", "--dataset", spec["order"], "--", *args])
    assert "Found no NVIDIA driver" in str(res.exception) + res.output, res.output
    train = built["train"]
    assert isinstance(train.dataset.transfer, sp.DumpTransfer)
    assert train.dataset.transfer.dump.dumps == [spec["dump"]]
    batch = next(iter(train))
    assert batch["hidden_states"].shape == (1, 512, 3 * H)
    # its defaults (train_data_ratio 0.9, seed 42) over merge's files, the same rows
    merged = loaders(spec, None, seed=42, total_seq_len=512, train_data_ratio=0.9)[0]
    same(batch, merged_batch(merged, next(iter(train.batch_sampler))))

    model, kwargs = built["model"], built["config"].train_call_kwargs
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    _, loss, _ = model(**batch, **kwargs)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    opt.step()
    with torch.no_grad():
        _, after, _ = model(**batch, **kwargs)
    assert np.isfinite(loss.item()) and after.item() < loss.item()


def test_an_unsupported_release_is_named_in_one_line(monkeypatch):
    import importlib.metadata

    assert sp.check() is None
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.8.2" if d == "speculators" else real(d))
    problem = sp.check()
    assert problem and "speculators 0.8.2 is not supported" in problem and "\n" not in problem


def test_a_damaged_dump_stops_hscap_train_with_verifys_one_line(spec, tmp_path):
    import shutil

    from hs_capture.offline.read.reader import open_runs

    broken = str(tmp_path / "dump")
    shutil.copytree(spec["dump"], broken)
    run = open_runs(broken)[0]
    path = run.index_path(next(iter(run.ranks)))
    lines = open(path).read().splitlines(keepends=True)
    with open(path, "w") as f:  # a line in the middle that is not JSON (a torn LAST line is not committed: fine)
        f.writelines(lines[:2] + ["{not json\n"] + lines[2:])
    args = ["--verifier-name-or-path", spec["target"], "--data-path", spec["data"], "--hidden-states-path", broken,
            "--target-layer-ids", "2", "3", "5", "--save-path", str(tmp_path / "ckpt"), "--num-workers", "0"]
    res = CliRunner().invoke(main, ["train", "speculators", "--dataset", spec["order"], "--", *args])
    assert res.exit_code == 1, res.output
    errors = [x for x in res.output.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1 and "line 3 is not a valid index line" in errors[0] and path in errors[0], res.output
    assert "Traceback" not in res.output


def test_an_unsupported_release_is_refused_in_one_line_before_the_trainer_starts(monkeypatch):
    monkeypatch.setattr(sp, "_version", lambda: "0.8.2")
    res = CliRunner().invoke(main, ["train", "speculators", "--", "--help"])
    assert res.exit_code == 1 and res.output.count("\n") == 1 and "0.8.2" in res.output, res.output
