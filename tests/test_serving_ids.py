"""The layer ids merge gives a trainer land, at serve time, on the layers that were captured:
checked against each installed sglang release's OWN `set_eagle3_layers_to_capture`, for every
family, every captured set of a small model, and SpecForge's, ModelOpt's and speculators'
settings as merge writes them."""

import itertools
import json
import os
import subprocess

import pytest

from hs_capture.dump.layer_ids import family_of, served_ids
from hs_capture.dump.schema import RankMeta
from tests.sglang_cpu.harness import REPO, SHIMS
from tests.sglang_cpu.matrix import release_pythons
from tests.test_versions import RELEASES

N = 6  # decoder layers: captured sets are taken from 1..N-1, as HSCAP_LAYERS allows
FAMILY = {"deepseek": "deepseek", "deepseek_v3": "deepseek", "kimi_k25": "deepseek", "llama": "llama",
          "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}
_PYTHONS = release_pythons()


def probe(python: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HSCAP_", "PYTHONPATH"))}
    env["PYTHONPATH"] = SHIMS
    out = subprocess.run([python, "-m", "tests.sglang_cpu.eagle_ids_probe", str(N)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("release", RELEASES)
def test_the_ids_for_sglang_land_on_the_captured_layers_in_its_own_code(release):
    python = _PYTHONS.get(release)
    if python is None:
        pytest.skip(f"no venv for sglang {release}: bash bin/setup_sglang_venv.sh {release}")
    found = probe(python)
    assert found["sglang"] == release
    for family, pairs in found["families"].items():
        real = {tuple(ids): layers for ids, layers in pairs}
        for k in (2, 3):
            for captured in itertools.combinations(range(1, N), k):
                served = served_ids(captured, "sglang", FAMILY[family], found["sglang"])
                reaching = [ids for ids, layers in real.items() if layers == list(captured)]
                if served.ids is None:  # no id list at all (any order) reaches it in SGLang's code
                    assert not reaching, (family, captured, reaching)
                    assert served.problem() and "first layer other than 1" in served.problem()
                else:
                    assert real[tuple(served.ids)] == list(captured), (family, captured, served.ids)
    # the case the old "entering - 1" rule got wrong: DeepSeek from 0.5.13 takes [0, 2, 4] as it is
    deepseek = {tuple(ids): layers for ids, layers in found["families"]["deepseek"]}
    assert served_ids([3, 4, 5], "sglang", "deepseek", release).ids == ([3, 4, 5] if release >= "0.5.13"
                                                                        else [2, 3, 4])
    assert deepseek[(2, 3, 4)] == ([2, 3, 4] if release >= "0.5.13" else [3, 4, 5])


def test_rules_by_release_and_what_merge_says_where_they_differ():
    default = served_ids([2, 30, 58], "sglang", "deepseek", "0.5.23")
    assert default.ids == [1, 29, 57] and default.note() is None  # every release agrees
    later = served_ids([3, 4, 5], "sglang", "deepseek", "0.5.23")
    assert later.ids == [3, 4, 5] and later.elsewhere == {"<0.5.13": [2, 3, 4]} and "<0.5.13" in later.note()
    first_one = served_ids([1, 3, 5], "sglang", "deepseek", "0.5.15.post1")
    assert first_one.ids is None and first_one.elsewhere == {"<0.5.13": [0, 2, 4]}
    assert "[1, 3, 5]" in first_one.problem() and "e.g. 2" in first_one.problem()
    assert served_ids([1, 3, 5], "sglang", "deepseek", "0.5.10").ids == [0, 2, 4]
    assert served_ids([1, 3, 5], "sglang", "llama", "0.5.23").ids == [0, 2, 4]
    assert served_ids([1, 3, 5], "vllm", "deepseek").ids == [1, 3, 5]
    assert served_ids([1, 3, 5], "sglang", "deepseek", None).ids is None  # unknown release: the newest rule


def test_the_family_comes_from_the_run_metadata_or_older_dumps_architectures():
    def meta(**kw):
        return RankMeta(layers=[2], hidden_size=8, **kw)

    assert family_of(meta(family="qwen3_moe", architectures=["LlamaForCausalLM"])) == "qwen3_moe"
    assert family_of(meta(architectures=["DeepseekV3ForCausalLM"],
                          served_architectures=["KimiK25ForConditionalGeneration"])) == "deepseek"
    assert family_of(meta(architectures=["Qwen3MoeForCausalLM"])) == "qwen3_moe"
    assert family_of(meta(architectures=["Qwen3ForCausalLM"])) == "qwen3"
    assert family_of(meta()) is None
