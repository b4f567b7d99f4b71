"""The training formats' readers on files written by hand (no server): a speculators file of the
wrong shape or types fails with the format's error, and the native index.json is refused, in
one line, by HsCaptureDataset and verify alike (one reader) when its version is unknown or a
shard path leaves the directory."""

import json
import struct

import pytest
import torch

from hs_capture.dump import hst as fmt
from hs_capture.offline.formats import FORMATS, ListingError, SampleRef
from hs_capture.offline.formats.speculators import save_safetensors
from hs_capture.offline.verify import verify

H = 8
SPECULATORS = FORMATS["speculators"]


def speculators_file(path, hidden_states, token_ids, meta=None):
    save_safetensors({"hidden_states": hidden_states, "token_ids": token_ids}, str(path), meta or {"rid": "r"})
    return str(path)


def raw_safetensors(path, header, payload=b""):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + payload)
    return str(path)


def load(path, hidden_size=None):
    return SPECULATORS.load(SampleRef("speculators", path, hidden_size=hidden_size), {})


def test_a_good_speculators_file_loads(tmp_path):
    s = load(speculators_file(tmp_path / "hs_0.safetensors", torch.randn(3, 4, H), torch.arange(3)), H)
    assert s.aux.shape == (3, 3 * H) and s.prenorm.shape == (3, H) and s.hidden_size == H and s.rid == "r"


@pytest.mark.parametrize("case", ["1.5x hidden", "3 states", "2-D states", "T differs", "float ids", "int states",
                                  "2-D ids"])
def test_a_speculators_file_of_the_wrong_shape_or_types_fails_with_the_formats_error(tmp_path, case):
    hs, ids = torch.randn(3, 4, H), torch.arange(3)
    hs, ids = {"1.5x hidden": (torch.randn(3, 4, H * 3 // 2), ids), "3 states": (torch.randn(3, 3, H), ids),
               "2-D states": (torch.randn(3, 4 * H), ids), "T differs": (hs, torch.arange(2)),
               "float ids": (hs, ids.float()), "int states": (torch.ones(3, 4, H, dtype=torch.int64), ids),
               "2-D ids": (hs, ids.view(3, 1))}[case]
    path = speculators_file(tmp_path / "hs_0.safetensors", hs, ids)
    with pytest.raises(fmt.FormatError):  # an hst rule, never a bare ValueError / TypeError
        load(path, H)


@pytest.mark.parametrize("entry", [{"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]},
                                   {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8.0]},
                                   {"dtype": "F32", "shape": [-2], "data_offsets": [8, 0]},
                                   {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}])
def test_safetensors_entries_of_the_wrong_types_fail_with_the_formats_error(tmp_path, entry):
    path = raw_safetensors(tmp_path / "hs_0.safetensors", {"hidden_states": entry}, bytes(8))
    with pytest.raises(fmt.FormatError):
        load(path)


def test_safetensors_metadata_and_overlaps_fail_with_the_formats_error(tmp_path):
    ids = {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}
    bad_meta = raw_safetensors(tmp_path / "a.safetensors", {"__metadata__": ["rid"], "token_ids": ids}, bytes(8))
    alias = raw_safetensors(tmp_path / "b.safetensors", {"token_ids": ids, "hidden_states": {
        "dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    for path in (bad_meta, alias):
        with pytest.raises(fmt.FormatError):
            load(path)


def test_verify_reports_a_speculators_file_wider_than_the_merge_recorded(tmp_path):
    (tmp_path / "merge_report.json").write_text(json.dumps({"format": "speculators", "hidden_size": H}))
    speculators_file(tmp_path / "hs_0.safetensors", torch.randn(3, 4, H * 3 // 2), torch.arange(3))
    (f,) = verify([str(tmp_path)]).findings
    assert f.check == "header" and f.message.startswith("TensorInvalidInfo: hidden_states is [3, 4, 12]")


def native_dir(root, version=1, shard="shards/part-0of1-000000.hst"):
    root.mkdir(exist_ok=True)
    index = {"format": "hscap-dataset", "version": version, "layers": [1, 2, 3], "hidden_size": H,
             "prenorm": False, "samples": [["a", 0, shard, 3]]}
    (root / "index.json").write_text(json.dumps(index))
    return str(root)


@pytest.mark.parametrize("how, why", [
    ({"version": 2}, "native index version 2: this hs_capture reads version 1"),
    ({"shard": "../elsewhere/part-0of1-000000.hst"}, "leaves the dataset dir"),
    ({"shard": "shards/../../part-0of1-000000.hst"}, "leaves the dataset dir"),
    ({"shard": "/tmp/part-0of1-000000.hst"}, "leaves the dataset dir"),
])
def test_the_dataset_and_verify_refuse_an_index_of_another_version_or_leaving_the_dir(tmp_path, how, why):
    from hs_capture.offline.train.dataset import HsCaptureDataset

    out = native_dir(tmp_path / "out", **how)
    with pytest.raises(ListingError, match=why) as e:
        HsCaptureDataset(out)
    assert str(e.value).startswith(f"{out}/index.json: ") and "\n" not in str(e.value)
    refused, nothing = verify([out]).findings  # then nothing left to check
    assert (refused.check, refused.path) == ("samples", f"{out}/index.json") and why in refused.message
    assert nothing.message.startswith("no merged sample found")


def test_the_dataset_needs_an_index(tmp_path):
    from hs_capture.offline.train.dataset import HsCaptureDataset

    with pytest.raises(FileNotFoundError, match="index.json"):
        HsCaptureDataset(str(tmp_path))
