import os

import pytest

from tests.sglang_cpu.harness import make_tiny_deepseek

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
