"""sglang 0.5.23's own aux capture (`--enable-return-aux-hidden-states`, states returned in
the JSON response) and the hook on the same REAL CPU server do not fight: each returns the
layers it was asked for, equal to transformers' float32 forward. SGLang's flag goes through the
same `set_eagle3_layers_to_capture` a served drafter's ids go through, so the ids
hs_capture.dump.layer_ids gives for layers 3,4 must come back as exactly those layers."""

import json
import urllib.request

import numpy as np
import sglang
from click.testing import CliRunner

from hs_capture.cli import main
from hs_capture.dump.layer_ids import served_ids
from tests.sglang_cpu.harness import Server, hf_hidden_states, server_env, write_jsonl

H = 256
NATIVE_LAYERS = [3, 4]  # what SGLang's own capture is to return (entering-layer indices)
# its --return-aux-hidden-state-layer-ids: [3, 4] on 0.5.23 (the old "layer - 1" gave [2, 3],
# which SGLang's DeepSeek rule takes as they are: layers 2, 3)
NATIVE_IDS = served_ids(NATIVE_LAYERS, "sglang", "deepseek", sglang.__version__).ids
OURS = "1,3,5"


def test_the_hook_and_sglangs_native_aux_capture_both_return_their_own_layers(tiny_model, tmp_path):
    dump = str(tmp_path / "dump")
    srv = Server(tiny_model, server_env(dump, HSCAP_LAYERS=OURS), str(tmp_path / "server.log"),
                 ["--chunked-prefill-size", "64", "--disable-radix-cache", "--enable-return-aux-hidden-states",
                  "--speculative-algorithm", "EAGLE3", "--return-aux-hidden-state-layer-ids",
                  *map(str, NATIVE_IDS)])
    prompts = {"n0": list(range(5, 45)), "n1": list(range(100, 250))}
    got = {}
    try:
        srv.wait_healthy()
        for rid, ids in prompts.items():
            body = json.dumps({"input_ids": ids, "rid": rid, "return_hidden_states": True,
                               "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).encode()
            req = urllib.request.Request(srv.url + "/generate", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                got[rid] = np.array(json.loads(r.read())["meta_info"]["hidden_states"][0], dtype=np.float32)
    finally:
        srv.stop()
    # the server log names both layer sets: SGLang's own (handed to it alone) and the hook's
    log = open(str(tmp_path / "server.log")).read()
    assert (f"layer sets: SGLang's own capture (a speculative drafter, or its aux-state flag) takes layers "
            f"{NATIVE_LAYERS}, handed to it alone; the hook captures {[int(x) for x in OURS.split(',')]}") in log
    for rid, ids in prompts.items():
        ref = hf_hidden_states(tiny_model, ids)
        a = got[rid]
        # chunked at 64: only the last chunk's rows come back (the finding), so compare those
        assert a.shape[1] == len(NATIVE_IDS) * H and a.shape[0] == len(ids) - 64 * ((len(ids) - 1) // 64)
        tail = slice(len(ids) - a.shape[0], len(ids))
        for j, k in enumerate(NATIVE_LAYERS):
            assert np.abs(a[:, j * H:(j + 1) * H] - ref[k][tail]).max() <= 1e-4, (rid, k)
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": rid, "input_ids": ids} for rid, ids in prompts.items()])
    res = CliRunner().invoke(main, ["verify", dump, "--dataset", data, "--reference", tiny_model, "--json"])
    doc = json.loads(res.output.strip().splitlines()[-1])
    assert res.exit_code == 0 and doc["ok"], doc
    assert doc["stats"]["samples_complete"] == len(prompts) and doc["stats"]["reference_samples"] == len(prompts)
