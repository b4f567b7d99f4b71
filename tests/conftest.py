import os
import random

import pytest

from tests.sglang_cpu.harness import make_tiny_deepseek, serve_and_send, server_env, write_jsonl

NUM_LAYERS = 6


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 6-layer random DeepSeek-V3 in float32, made with transformers at test time."""
    return make_tiny_deepseek(str(tmp_path_factory.mktemp("tiny-dsv3")), layers=NUM_LAYERS)


@pytest.fixture
def clean_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith(("HSCAP_", "SGLANG_HS_")):
            monkeypatch.delenv(k)
    return monkeypatch


@pytest.fixture(scope="session")
def served_dump(tiny_model, tmp_path_factory):
    """One dump from the REAL CPU server, shared by the merge and verify suites (read-only:
    tests that damage it work on a copy). Layers 2,3,5 (the drafter ids SGLang serves them on: 1,2,4), pre-norm on, chunked at 128, -c 8."""
    root = tmp_path_factory.mktemp("served")
    rng = random.Random(7)
    rows = []
    for i, n in enumerate([1, 5, 64, 130, 257, 400, 33, 600, 12, 99, 300, 2]):
        ids = [rng.randrange(2, 1000) for _ in range(n)]
        rows.append({"id": f"m/{i}:x", "input_ids": ids, "loss_mask": [rng.randrange(2) for _ in range(n)]})
    data = write_jsonl(root / "data.jsonl", rows)
    d = str(root / "dump")
    srv = serve_and_send(tiny_model, server_env(d, HSCAP_LAYERS="2,3,5", HSCAP_PRENORM="1"), root,
                         ["--chunked-prefill-size", "128", "--disable-radix-cache"], data, len(rows), concurrency=8)
    assert "final state post-norm and pre-norm" in srv.log()
    return {"dir": d, "rows": rows, "data": data, "root": root}
