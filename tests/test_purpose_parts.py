"""The pure parts of the GPU proof of purpose (benchmarks/gpu/purpose.py): the synthetic
language the target learns, and the int4 expert packing checked with compressed-tensors' own
unpacker (the code SGLang's loader relies on for that format)."""

import json
import os
import random
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks", "gpu"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "benchmarks", "gpu", "lib"))

import language  # noqa: E402


def test_language_is_seeded_and_walks_its_phrases():
    a, b, c = language.Grammar(0), language.Grammar(0), language.Grammar(1)
    assert a.phrases == b.phrases and a.successors == b.successors
    assert a.phrases != c.phrases
    text = a.text(random.Random(5), 400)
    assert text == b.text(random.Random(5), 400) and len(text) == 400
    assert all(language.FIRST_ID <= t < language.FIRST_ID + language.ALPHABET for t in text)
    # the text is a walk: it parses greedily into phrases, each one a successor of the one before
    i, prev = 0, None
    while i + 8 < len(text):
        nxt = [p for p in (a.successors[prev] if prev is not None else range(language.PHRASES))
               if text[i:i + len(a.phrases[p])] == a.phrases[p]]
        assert nxt, f"no phrase starts at {i}"
        prev = nxt[0]
        i += len(a.phrases[prev])


def test_best_possible_accuracy_follows_the_successor_weights():
    g = language.Grammar(0)
    best = g.oracle(random.Random(0))
    mean_len = sum(map(len, g.phrases)) / len(g.phrases)
    # one uncertain position per phrase, right at most 60% of the time
    assert 1 - 0.4 / (mean_len - 1.5) < best < 1 - 0.4 / (mean_len + 1.5)


def test_int4_packing_is_what_compressed_tensors_unpacks():
    torch = pytest.importorskip("torch")
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    import int4

    w = torch.randn(48, 128) * 0.05
    packed, scale, deq = int4.quantize(w)
    assert packed.dtype == torch.int32 and packed.shape == (48, 16) and scale.shape == (48, 128 // int4.GROUP)
    q = helpers.unpack_from_int32(packed, 4, torch.Size([48, 128]))
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    assert torch.equal(helpers.pack_to_int32(q.to(torch.int8), 4), packed)
    rebuilt = (q.float().reshape(48, -1, int4.GROUP) * scale.float().unsqueeze(-1)).reshape(48, 128)
    assert torch.equal(rebuilt, deq)
    assert (deq - w).abs().max() <= scale.float().max() / 2 + 1e-6  # rounding, never clipping


def test_int4_checkpoint_keeps_the_release_layout(tmp_path):
    pytest.importorskip("torch")
    from safetensors import safe_open
    from tests.sglang_cpu import models

    import int4

    src = models.make_tiny("kimi_k25", str(tmp_path / "kimi"), layers=3)
    out = str(tmp_path / "kimi-int4")
    res = int4.main(src, out)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert cfg["quantization_config"]["format"] == "pack-quantized"
    # served in bf16 as released: SGLang takes the dtype from the text config (a float32 one
    # would be served in float16)
    assert cfg["text_config"]["torch_dtype"] == cfg["text_config"]["dtype"] == "bfloat16"
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    experts = [k for k in keys if ".mlp.experts." in k]
    assert experts and all(k.endswith((".weight_packed", ".weight_scale", ".weight_shape")) for k in experts)
    assert res["expert_matrices_quantized"] == len(experts) // 3
    # attention, shared experts and the dense layer stay as they were
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in keys
    assert any(".shared_experts." in k and k.endswith(".weight") for k in keys)
    with safe_open(os.path.join(out, "text_model", "model.safetensors"), "pt") as f:
        ref_keys = set(f.keys())
    with safe_open(os.path.join(src, "text_model", "model.safetensors"), "pt") as f:
        assert ref_keys == set(f.keys())


def test_the_controls_move_states_not_tokens():
    torch = pytest.importorskip("torch")
    import purpose

    T, H = 5, 2
    d = {"input_ids": torch.arange(T), "loss_mask": torch.ones(T, dtype=torch.int64),
         "aux_hidden_state": torch.arange(T * 3 * H, dtype=torch.float32).reshape(1, T, 3 * H),
         "hidden_state": torch.arange(T * H, dtype=torch.float32).reshape(1, T, H) + 100}
    s = purpose.shift_one_token(d)
    assert torch.equal(s["input_ids"], d["input_ids"]) and torch.equal(s["loss_mask"], d["loss_mask"])
    for k in ("aux_hidden_state", "hidden_state"):
        assert torch.equal(s[k][:, 1:], d[k][:, :-1]) and torch.equal(s[k][:, 0], d[k][:, 0])
    r = purpose.rotate_layers(d, H)
    a, b = d["aux_hidden_state"], r["aux_hidden_state"]
    assert torch.equal(b[..., :H], a[..., 2 * H:]) and torch.equal(b[..., H:], a[..., :2 * H])
    assert torch.equal(r["hidden_state"], d["hidden_state"])


def test_the_k25_slice_keeps_the_targets_files_and_takes_k25s_widths(tmp_path):
    """rate_sweep --shape k25: the small target's files without its weights, K2.5's widths in
    the text config (its weights are SGLang's dummy ones); made once."""
    import rate_sweep

    src, dst = tmp_path / "model", tmp_path / "model-k25"
    (src / "text_model").mkdir(parents=True)
    (src / "text_model" / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"w" * 64)
    (src / "processing_tiny_kimi.py").write_text("# remote code")
    (src / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": {"hidden_size": 1024, "num_hidden_layers": 6, "n_routed_experts": 24, "vocab_size": 1024},
        "vision_config": {"text_hidden_size": 1024}}))
    assert rate_sweep.slice_model(str(src), str(dst)) == str(dst)
    assert sorted(os.listdir(dst)) == ["config.json", "processing_tiny_kimi.py"]
    config = json.loads((dst / "config.json").read_text())
    text = config["text_config"]
    assert {k: text[k] for k in rate_sweep.K25_TEXT} == rate_sweep.K25_TEXT
    assert text["num_hidden_layers"] == rate_sweep.SLICE_LAYERS and text["n_routed_experts"] == rate_sweep.SLICE_EXPERTS
    assert text["n_routed_experts"] >= text["num_experts_per_tok"] and text["vocab_size"] == 1024
    assert config["vision_config"]["text_hidden_size"] == 7168
    (src / "config.json").write_text("not read again")
    assert rate_sweep.slice_model(str(src), str(dst)) == str(dst)  # already made: kept


def test_each_alternating_round_is_judged_against_the_plain_rounds_beside_it():
    import rate_sweep

    rounds = [{"round": r, "tokens_per_s": t} for r, t in
              [("off", 100), ("on", 90), ("off", 80), ("off-burn", 72), ("off", 100), ("on-split", 50), ("off-split", 60)]]
    got = rate_sweep.summarize_rounds(rounds)
    assert got["on_over_off"] == {"on": [1.0], "off-burn": [0.8], "on-split": [round(50 / 60, 4)]}
    assert got["off_tokens_per_s"] == [100, 80, 100, 60]
