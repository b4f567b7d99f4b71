"""Feature detection against the real sglang in the test venv (nothing published: a bare
process; or a real ServerArgs published as a 0.5.23 scheduler does), plus the flag logic for
releases that only have server-args flags."""

import contextlib
import os
import sys

import pytest

from hs_capture.server import sglang_compat as compat
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


def _pp_group(stage: int, stages: int):
    """SGLang's own GroupCoordinator of a pipeline, as its __init__ leaves it in the process of
    `stage` (rank bookkeeping only: no process group is built on a CPU test machine)."""
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    group = object.__new__(GroupCoordinator)
    group.ranks = list(range(stages))
    group.rank = group.ranks[stage]
    group.world_size, group.rank_in_group = len(group.ranks), group.ranks.index(group.rank)
    return group


def test_a_non_last_pipeline_stage_does_not_write():
    first, last = (compat.parallel_info(_pp_group(stage, 2)) for stage in (0, 1))
    assert first.rank.pp == 0 and first.pp_size == 2 and not first.writes  # not the last stage: nothing to write
    # the last stage writes, under its own pipeline rank
    assert (last.rank.pp, last.pp_size, last.writes, last.rank.tag) == (1, 2, True, "dp0-tp0-pp1")


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


def test_the_flags_read_from_a_release_source_are_the_ones_it_gives_when_imported():
    """`hscap serve` reads the release's field declarations instead of importing it (~8 s): for
    every release here, the same answer as importing its ServerArgs gives."""
    from hs_capture.cli.serve_cmd import graph_off_flags_asked, graph_off_flags_declared
    from tests.sglang_cpu.matrix import release_pythons

    for release, python in release_pythons().items():
        declared = graph_off_flags_declared(python)
        assert declared is not None and declared == graph_off_flags_asked(python), release


def _fake_release(root, server_args: str) -> str:
    """A package named sglang with only a server_args module: the reader's own input, not SGLang."""
    srt = root / "sglang" / "srt"
    srt.mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    (srt / "__init__.py").write_text("")
    (srt / "server_args.py").write_text(server_args)
    return str(root)


def test_only_a_class_body_declaration_counts_and_an_unread_layout_is_asked(tmp_path, monkeypatch):
    from hs_capture.cli.serve_cmd import graph_off_flags
    from hs_capture.server import release_source

    fields = compat.PREFILL_GRAPH_FIELDS
    mentions = ('def hook(\n'
                '    disable_prefill_cuda_graph: bool = False,\n'
                '):\n'
                '    disable_prefill_cuda_graph: bool = True\n'
                'class ServerArgs:\n'
                '    # disable_prefill_cuda_graph: not a field\n'
                '    disable_cuda_graph: bool = False\n'
                '    def resolve(self):\n'
                '        disable_prefill_cuda_graph: bool = True\n'
                '        help = """\n'
                'disable_piecewise_cuda_graph: text\n'
                '"""\n')
    root = _fake_release(tmp_path / "a", mentions + "    disable_piecewise_cuda_graph: bool = False\n")
    assert release_source.declared_fields(os.path.join(root, "sglang"), fields) == {"disable_piecewise_cuda_graph"}
    # 0.5.2x declares its fields in arg_groups/
    group = tmp_path / "a" / "sglang" / "srt" / "arg_groups" / "fields"
    group.mkdir(parents=True)
    (group / "exec_.py").write_text("class Exec:\n    disable_prefill_cuda_graph: A[bool, 'x'] = False\n")
    assert release_source.declared_fields(os.path.join(root, "sglang"), fields) == set(fields)
    # a file this Python cannot parse says nothing
    (group / "exec_.py").write_text("class Exec:\n    disable_prefill_cuda_graph: A[bool = False\n")
    assert release_source.declared_fields(os.path.join(root, "sglang"), fields) == {"disable_piecewise_cuda_graph"}

    # a release declaring the field some other way: its own ServerArgs is asked
    other = _fake_release(tmp_path / "b", "class ServerArgs:\n    disable_piecewise_cuda_graph = False\n")
    monkeypatch.setenv("PYTHONPATH", other)
    assert release_source.package_dir(sys.executable) == os.path.join(other, "sglang")
    assert release_source.declared_fields(os.path.join(other, "sglang"), fields) == set()
    assert graph_off_flags(sys.executable) == ["--disable-piecewise-cuda-graph"]
    assert release_source.package_dir(os.path.join(str(tmp_path), "no-python")) is None


def _graph_config(decode, prefill):
    """SGLang's own resolved CUDA-graph config (0.5.15 kept it on ServerArgs.cuda_graph_config)."""
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig

    return CudaGraphConfig(decode=PhaseConfig(backend=decode), prefill=PhaseConfig(backend=prefill))


@pytest.fixture(scope="module")
def published(tiny_model):
    """Real ServerArgs of the tiny DeepSeek-V3, resolved and published as a 0.5.23 scheduler
    does it: the resolved CUDA-graph config is then in runtime_context.get_exec(), and only
    there (the args keep what the operator typed). The context, and the environment variables
    ServerArgs sets, are restored on exit."""
    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs

    @contextlib.contextmanager
    def publish(**flags):
        env = dict(os.environ)
        try:
            args = ServerArgs(model_path=tiny_model, device="cuda", **flags)
            with runtime_context.use_context(runtime_context.create_context(args, role="scheduler")):
                yield args
        finally:
            for k in set(os.environ) - set(env):
                del os.environ[k]
            os.environ.update(env)

    return publish


@pytest.mark.parametrize("source, args, overlap, decode, prefill, wrong", [
    # 0.5.15, DeepSeek (MLA) with default flags: SGLang itself turns breakable prefill graphs off
    ("args", {"device": "cuda", "cuda_graph_config": ("full", "disabled")}, True, "full", None, []),
    ("args", {"device": "cuda", "cuda_graph_config": ("full", "breakable")}, True, "full",
     "cuda_graph_backend_prefill=breakable", ["prefill CUDA graphs"]),
    ("args", {"device": "cuda", "disable_overlap_schedule": True, "disable_cuda_graph": True}, False, None, None, []),
    ("args", {"device": "cuda", "disable_prefill_cuda_graph": True}, True, "on", None, []),
    ("args", {"device": "cuda", "disable_prefill_cuda_graph": True, "enable_two_batch_overlap": True}, True, "on",
     None, ["two-batch overlap"]),
    ("args", {"device": "cpu"}, True, None, None, []),
    # a real 0.5.23 server (its published ServerArgs and resolved config), launched with these flags.
    # Prefill graphs asked for in --cuda-graph-config: no flag of their own says so, only what
    # SGLang resolved from it
    ("published", {"cuda_graph_config": {"prefill": {"backend": "breakable"}}}, True, "full",
     "cuda_graph_backend_prefill=breakable", ["prefill CUDA graphs"]),
    ("published", {"cuda_graph_backend_prefill": "breakable"}, True, "full", "cuda_graph_backend_prefill=breakable",
     ["prefill CUDA graphs"]),
    ("published", {"disable_prefill_cuda_graph": True}, True, "full", None, []),
    ("published", {"disable_prefill_cuda_graph": True, "cuda_graph_backend_decode": "disabled"}, True, None, None, []),
    ("published", {"disable_overlap_schedule": True, "disable_cuda_graph": True}, False, None, None, []),
    ("published", {"disable_prefill_cuda_graph": True, "enable_two_batch_overlap": True}, True, "full", None,
     ["two-batch overlap"]),
])
def test_server_modes_and_the_ones_capture_refuses(published, source, args, overlap, decode, prefill, wrong):
    from hs_capture.server.modes import read_modes

    if source == "published":
        with published(**args) as server:
            assert compat.server_args() is server  # what the hook reads at start-up
            m = read_modes(compat.server_args())
    else:
        if "cuda_graph_config" in args:
            args = {**args, "cuda_graph_config": _graph_config(*args["cuda_graph_config"])}
        m = read_modes(args)
    assert (m.overlap, m.decode_graphs, m.prefill_graphs) == (overlap, decode, prefill)
    assert [w.what for w in m.wrong()] == wrong
    assert ("overlap (default)" if overlap else "normal") in m.describe()
