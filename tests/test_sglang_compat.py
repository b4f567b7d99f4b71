"""Feature detection against the real sglang in the test venv (nothing published: a bare
process), plus the flag logic for releases that only have server-args flags."""

import sys

import pytest

from hs_capture import sglang_compat as compat
from tests.sglang_cpu.harness import SHIMS

sys.path.insert(0, SHIMS)


@pytest.mark.parametrize("args, expect", [
    ({"device": "cpu"}, None),  # graphs are CUDA-only
    ({"device": "cuda", "disable_cuda_graph": True}, None),
    ({"device": "cuda", "disable_prefill_cuda_graph": True, "cuda_graph_backend_prefill": "breakable"}, None),
    ({"device": "cuda", "cuda_graph_backend_prefill": "breakable"}, "cuda_graph_backend_prefill=breakable"),
    ({"device": "cuda", "cuda_graph_backend_prefill": "disabled"}, None),
    ({"device": "cuda", "enable_piecewise_cuda_graph": True}, "enable_piecewise_cuda_graph"),
    ({"device": "cuda", "enable_piecewise_cuda_graph": True, "disable_piecewise_cuda_graph": True}, None),
    # 0.5.10-0.5.14: piecewise prefill graphs on by default; --disable-cuda-graph leaves them on
    ({"device": "cuda", "disable_cuda_graph": True, "disable_piecewise_cuda_graph": False}, compat.PIECEWISE_DEFAULT_ON),
    ({"device": "cuda", "disable_cuda_graph": True, "disable_piecewise_cuda_graph": True}, None),
])
def test_prefill_graph_detection_from_flags(args, expect):
    import sglang.srt.model_executor.cuda_graph_config  # noqa: F401  the real module, unpublished here

    assert compat.prefill_graph_state(args) == expect


def test_ranks_default_to_a_single_process_without_distributed_state():
    info = compat.parallel_info(None)
    assert info.rank.tag == "dp0-tp0-pp0" and info.writes and info.tp_size >= 1


def test_a_non_last_pipeline_stage_does_not_write():
    class PP:
        rank_in_group, world_size, is_last_rank = 0, 2, False

    info = compat.parallel_info(PP())
    assert info.rank.pp == 0 and not info.writes  # not the last stage: nothing to write


def test_relevant_flags_keep_scalars_only():
    flags = compat.relevant_flags({"chunked_prefill_size": 128, "disable_radix_cache": True,
                                   "dtype": object(), "unrelated": 1})
    assert flags["chunked_prefill_size"] == 128 and flags["disable_radix_cache"] is True
    assert isinstance(flags["dtype"], str) and "unrelated" not in flags


def test_sglang_version_is_read_from_metadata():
    assert compat.sglang_version() == "0.5.23"


def test_the_flags_that_keep_prefill_eager_are_asked_of_the_release():
    from hs_capture.cli.serve_cmd import graph_off_flags
    from tests.sglang_cpu.matrix import release_pythons

    pythons = release_pythons()
    # the prefill phase alone: decode CUDA graphs stay on
    assert graph_off_flags(pythons["0.5.23"]) == ["--disable-prefill-cuda-graph"]
    if "0.5.15" in pythons:  # where bin/setup_sglang_venv.sh 0.5.15 made it
        assert graph_off_flags(pythons["0.5.15"]) == ["--disable-prefill-cuda-graph"]
    if "0.5.10" in pythons:
        assert graph_off_flags(pythons["0.5.10"]) == ["--disable-piecewise-cuda-graph"]
    assert compat.prefill_graph_off_flags({"disable_piecewise_cuda_graph"}) == ["--disable-piecewise-cuda-graph"]
    assert compat.prefill_graph_off_flags({"disable_prefill_cuda_graph", "disable_cuda_graph"}) == [
        "--disable-prefill-cuda-graph"]
    assert compat.prefill_graph_off_flags(set()) == ["--disable-cuda-graph"]


class _Phase:
    def __init__(self, backend):
        self.backend = backend


class _GraphConfig:  # sglang 0.5.15's resolved ServerArgs.cuda_graph_config
    def __init__(self, decode, prefill):
        self.decode, self.prefill = _Phase(decode), _Phase(prefill)


@pytest.mark.parametrize("args, overlap, decode, prefill, wrong", [
    # 0.5.15, DeepSeek (MLA) with default flags: SGLang itself turns breakable prefill graphs off
    ({"device": "cuda", "cuda_graph_config": _GraphConfig("full", "disabled")}, True, "full", None, []),
    ({"device": "cuda", "cuda_graph_config": _GraphConfig("full", "breakable")}, True, "full",
     "cuda_graph_backend_prefill=breakable", ["prefill CUDA graphs"]),
    ({"device": "cuda", "disable_overlap_schedule": True, "disable_cuda_graph": True}, False, None, None, []),
    ({"device": "cuda", "disable_prefill_cuda_graph": True}, True, "on", None, []),
    ({"device": "cuda", "disable_prefill_cuda_graph": True, "enable_two_batch_overlap": True}, True, "on", None,
     ["two-batch overlap"]),
    ({"device": "cpu"}, True, None, None, []),
])
def test_server_modes_and_the_ones_capture_refuses(args, overlap, decode, prefill, wrong):
    from hs_capture.modes import read_modes

    m = read_modes(args)
    assert (m.overlap, m.decode_graphs, m.prefill_graphs) == (overlap, decode, prefill)
    assert [w.what for w in m.wrong()] == wrong
    assert ("overlap (default)" if overlap else "normal") in m.describe()
