"""A layer set the model cannot have is refused before SGLang starts, in one line, and a
refused start leaves nothing on disk: through `hscap serve` (the real CLI, checked against
the checkpoint's config.json), and on a server started without it (the real sglang)."""

import os
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from tests.sglang_cpu.harness import CPU_FLAGS, LAUNCHER, REPO, free_port, graph_flags, server_env


def _server_flags(model: str, *extra: str, launcher: bool = True) -> list:
    """The flags the CPU needs; `hscap serve` adds the release's prefill-graph flag itself."""
    return ["--model-path", model, "--dtype", "float32", *CPU_FLAGS, *(() if launcher else graph_flags(sys.executable)),
            "--port", str(free_port()), *extra]


def _run(cmd: list, env: dict, timeout: float = 300.0):
    """(exit status, stdout+stderr, seconds). A start that is not refused runs until SGLang
    gives up (the old code: its scheduler fails at model load and SIGKILLs the server)."""
    tmp = tempfile.mkdtemp(prefix="sglang-")  # SGLang's ZMQ socket files, which it never removes
    t0 = time.monotonic()
    try:
        out = subprocess.run(cmd, cwd=REPO, env={**env, "TMPDIR": tmp}, capture_output=True, text=True,
                             timeout=timeout, stdin=subprocess.DEVNULL)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out.returncode, out.stdout + out.stderr, time.monotonic() - t0


def _tree(path) -> dict:
    """Every entry under `path` with its mtime: what "stays as it was" compares."""
    return {os.path.relpath(os.path.join(d, n), path): os.lstat(os.path.join(d, n)).st_mtime_ns
            for d, dirs, names in os.walk(path) for n in dirs + names} | {".": os.lstat(path).st_mtime_ns}


@pytest.fixture(scope="module")
def tiny_kimi(tmp_path_factory):
    """A KimiK25ForConditionalGeneration: its layer count is the text_config's, not the top level's."""
    from tests.sglang_cpu.models import make_tiny

    return make_tiny("kimi_k25", str(tmp_path_factory.mktemp("tiny-kimi")), 6)


@pytest.mark.parametrize("layers, message", [
    ("9", "HSCAP_LAYERS has [9] outside 1..5 for this 6-layer model"),
    ("1,6", "HSCAP_LAYERS has [6] outside 1..5 for this 6-layer model"),
    ("2,x", "HSCAP_LAYERS='2,x': 'x' is not a layer index"),
])
@pytest.mark.parametrize("model", ["deepseek_v3", "kimi_k25"])
def test_hscap_serve_refuses_a_bad_layer_set_before_sglang_starts(tiny_model, tiny_kimi, tmp_path, model, layers,
                                                                    message):
    path = tiny_model if model == "deepseek_v3" else tiny_kimi
    dump = tmp_path / "dump"
    rc, out, took = _run([LAUNCHER, "-d", str(dump), "--layers", layers, "--", *_server_flags(path)],
                         server_env(None, hook=False))
    assert rc == 1, out[-3000:]
    assert out.splitlines() == [out.strip()] and out.startswith(f"hscap serve: {message}"), out[-3000:]
    assert took < 30, f"{took:.0f} s: SGLang was started"  # a real start takes 20-80 s on this machine
    assert not dump.exists() and os.listdir(tmp_path) == []


@pytest.mark.parametrize("where, message", [("missing", "no such directory"), ("empty", "holds no config.json")])
def test_hscap_serve_refuses_a_local_model_path_that_holds_no_model_in_one_line(tmp_path, where, message):
    model = tmp_path / where
    if where == "empty":
        model.mkdir()
    dump = tmp_path / "dump"
    rc, out, took = _run([LAUNCHER, "-d", str(dump), "--", *_server_flags(str(model))], server_env(None, hook=False))
    assert rc == 1 and out.splitlines() == [out.strip()], out[-3000:]
    assert out.startswith(f"hscap serve: --model-path {model}: {message}") and took < 30
    assert not dump.exists()


def test_hscap_serve_leaves_an_existing_dump_dir_as_it_was(tiny_model, tmp_path):
    dump = tmp_path / "dump"
    (dump / "run-earlier" / "ranks").mkdir(parents=True)
    (dump / "run-earlier" / "ranks" / "dp0-tp0-pp0.json").write_text("{}")
    time.sleep(0.01)  # a write during the refusal would show in the mtimes
    before = _tree(dump)
    rc, out, _ = _run([LAUNCHER, "-d", str(dump), "--layers", "2,30,58", "--", *_server_flags(tiny_model)],
                      server_env(None, hook=False))
    assert rc == 1 and "HSCAP_LAYERS has [30, 58] outside 1..5 for this 6-layer model" in out, out[-3000:]
    assert _tree(dump) == before


def test_hscap_serve_lets_a_good_or_unknowable_layer_set_through(tiny_model, tmp_path):
    env = server_env(None, hook=False)
    dump = str(tmp_path / "dump")
    # --python /bin/true: its release probe fails fast (a fallback flag); the command is only printed
    ok = [LAUNCHER, "-d", dump, "--python", "/bin/true", "--dry-run", "--layers"]
    for layers, model in [("1,5", tiny_model), ("99", "deepseek-ai/DeepSeek-V3")]:  # a hub id: the server checks
        rc, out, _ = _run([*ok, layers, "--", "--model-path", model], env)
        assert rc == 0 and "-m sglang.launch_server" in out, out
    # SGLang applies a layer count given in --json-model-override-args over the file's
    rc, out, _ = _run([*ok, "9", "--", "--model-path", tiny_model, "--json-model-override-args",
                       '{"num_hidden_layers": 12}'], env)
    assert rc == 0 and "-m sglang.launch_server" in out, out
    assert os.listdir(tmp_path) == []


def test_a_server_without_the_launcher_refuses_in_one_line_and_creates_nothing(tiny_model, tmp_path):
    """PYTHONPATH=hook HSCAP_LAYERS=... python -m sglang.launch_server: refused as soon as the
    arguments parse, before SGLang starts a process or loads a weight."""
    dump = tmp_path / "dump"
    rc, out, took = _run([sys.executable, "-m", "sglang.launch_server", *_server_flags(tiny_model, launcher=False)],
                         server_env(str(dump), HSCAP_LAYERS="1,9"))
    ours = [line for line in out.splitlines() if "HS_DUMP" in line]
    assert rc == 1 and ours == ["[HS_DUMP] ERROR: HSCAP_LAYERS has [9] outside 1..5 for this 6-layer model "
                                "(index i = input of decoder layer i; the final state is always captured)"], out[-3000:]
    assert "Traceback" not in out and "Scheduler" not in out, out[-3000:]
    assert not dump.exists() and os.listdir(tmp_path) == []


def test_a_refusal_at_model_load_leaves_no_dump_dir(tiny_model, tmp_path):
    """Where the count is not knowable before the model loads (here: SGLang is told the count
    with --json-model-override-args, as for a hub id), the model-load check refuses; SGLang
    then stops its own way (a scheduler traceback and a SIGKILL), and nothing is left behind."""
    dump = tmp_path / "dump"
    rc, out, _ = _run([sys.executable, "-m", "sglang.launch_server",
                       *_server_flags(tiny_model, "--json-model-override-args", '{"num_hidden_layers": 6}',
                                     launcher=False)],
                      server_env(str(dump), HSCAP_LAYERS="1,9"))
    assert rc != 0 and "[HS_DUMP] ERROR: HSCAP_LAYERS has [9] outside 1..5 for this 6-layer model" in out, out[-3000:]
    assert not dump.exists() and os.listdir(tmp_path) == []


def test_the_rule_is_the_model_loads_rule(tmp_path):
    """config.check_checkpoint_layers reads what the server will build: a wrapper's text
    model, nothing for what it cannot know, and the default layers of a model too small for any."""
    from hs_capture.server import config
    from hs_capture.server.config import ConfigError

    def ckpt(name, body):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(body)
        return str(d)

    wrapper = ckpt("wrapper", '{"num_hidden_layers": 99, "text_config": {"num_hidden_layers": 6}}')
    assert config.check_checkpoint_layers({"HSCAP_LAYERS": "1,5"}, wrapper) == [1, 5]
    with pytest.raises(ConfigError, match=r"\[9\] outside 1..5"):
        config.check_checkpoint_layers({"HSCAP_LAYERS": "9"}, wrapper)
    assert config.check_checkpoint_layers({}, ckpt("plain", '{"num_hidden_layers": 61}')) == [2, 30, 58]
    with pytest.raises(ConfigError, match="1-layer model has no layer 1..0"):
        config.check_checkpoint_layers({}, ckpt("one", '{"num_hidden_layers": 1}'))
    for unknowable in ("org/model", ckpt("broken", "{not json"), ckpt("nocount", '{"text_config": {}}'),
                       str(tmp_path / "missing")):
        assert config.check_checkpoint_layers({"HSCAP_LAYERS": "9"}, unknowable) is None
    with pytest.raises(ConfigError, match="'x' is not a layer index"):  # malformed: refused even then
        config.check_checkpoint_layers({"HSCAP_LAYERS": "2,x"}, "org/model")
