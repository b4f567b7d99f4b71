"""`hscap doctor` in a real environment (sglang 0.5.23 installed, no server started): what
it finds, what it warns about, and when it says the server must not be started."""

import json
import os
import subprocess
import sys

import pytest

from tests.sglang_cpu.harness import REPO, SHIMS

sys.path.insert(0, SHIMS)  # the import-only vllm stand-in SGLang needs on a CPU machine (in-process tests)

HOOK = os.path.join(REPO, "hs_capture", "sitecustomize")


def start_doctor(tmp_path, *flags, pythonpath=None, dump=True) -> subprocess.Popen:
    """`hscap doctor --json [-- flags]` in a fresh interpreter (the hook is loaded at its start)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HSCAP_", "SGLANG_HS_"))}
    env["PYTHONPATH"] = os.pathsep.join(pythonpath if pythonpath is not None else [HOOK])
    env["TORCHDYNAMO_DISABLE"] = "1"
    if dump:
        env["HSCAP_DIR"] = str(tmp_path / "dump")
    cmd = [sys.executable, "-m", "hs_capture.cli", "doctor", "--json"] + (["--", *flags] if flags else [])
    # its output to files: several run at once, and a full pipe would stop one the test is not reading yet
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL)


def doctor_result(tmp_path, proc: subprocess.Popen) -> tuple:
    """(exit code, findings by topic) of a doctor started in that dir."""
    try:
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert "Traceback" not in err, err[-3000:]
    doc = json.loads(out.strip().splitlines()[-1])
    return proc.returncode, {f["topic"]: f for f in doc["findings"]}


@pytest.fixture(scope="module")
def doctored(tmp_path_factory):
    """Every environment the tests below run `hscap doctor` in, each in a process of its own,
    all started at once: each imports SGLang (~13 s of one core here), which leaves the
    machine's other cores idle. Returns (name -> (exit code, findings by topic), the user's
    own sitecustomize dir)."""
    root = tmp_path_factory.mktemp("doctor")
    other = root / "site"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['OTHER_SITE_RAN'] = '1'\n")
    other = str(other)
    calls = {
        "ready": (("--model-path", "m", "--tp", "2", "--disable-radix-cache", "--disable-cuda-graph"),
                  {"pythonpath": [HOOK, other]}),
        "shadowed": ((), {"pythonpath": [other, HOOK]}),
        "no hook": ((), {"pythonpath": []}),
        "no dump dir": ((), {"dump": False}),
        "no target": (("--model-path", _checkpoint(root, "gpt2", "GPT2LMHeadModel"), "--disable-cuda-graph"), {}),
    }
    procs = {}
    try:
        for name, (flags, kw) in calls.items():
            (root / name.replace(" ", "-")).mkdir()
            procs[name] = start_doctor(root / name.replace(" ", "-"), *flags, **kw)
        return {name: doctor_result(root / name.replace(" ", "-"), p) for name, p in procs.items()}, other
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_ready_environment_and_what_the_flags_mean(doctored):
    (code, f), other_sitecustomize = doctored[0]["ready"], doctored[1]
    assert code == 0
    assert f["sglang"]["status"] == "ok" and "0.5.23" in f["sglang"]["detail"]
    assert f["target DeepseekV2ForCausalLM"]["status"] == "ok"
    assert f["covered KimiK25ForConditionalGeneration"]["status"] == "ok"
    assert f["sitecustomize"]["status"] == "ok" and other_sitecustomize in f["sitecustomize"]["detail"]
    assert f["prefill CUDA graphs"]["status"] == "ok" and f["radix cache"]["status"] == "ok"
    assert f["tensor parallel"]["status"] == "info" and "TP rank 0 writes" in f["tensor parallel"]["detail"]


def in_process(argv):
    """diagnose() in this process (sglang is imported once here): the judgement of flags and
    models. The subprocess tests above prove the command itself."""
    from hs_capture.server.doctor import BLOCK, diagnose

    findings = {f.topic: f for f in diagnose(argv)}
    return (1 if any(f.status == BLOCK for f in findings.values()) else 0), findings


@pytest.mark.parametrize("flags,topic,status", [
    (("--cuda-graph-backend-prefill", "breakable"), "prefill CUDA graphs", "block"),
    (("--disable-cuda-graph",), "radix cache", "ok"),  # captured requests get their own namespace
    (("--disable-cuda-graph", "--enable-two-batch-overlap"), "two-batch overlap", "block"),
    # the server's defaults: overlap scheduler and decode CUDA graphs, both right with capture
    (("--disable-prefill-cuda-graph",), "scheduler", "ok"),
    (("--disable-prefill-cuda-graph",), "decode CUDA graphs", "ok"),
    (("--disable-prefill-cuda-graph",), "prefill CUDA graphs", "ok"),
    (("--disable-cuda-graph", "--tp", "2", "--dp", "2", "--enable-dp-attention"), "dp attention", "info"),
    ((), "prefill CUDA graphs", None),  # no flags given: not judged
])
def test_flags_that_break_or_thin_capture(tmp_path, monkeypatch, flags, topic, status):
    monkeypatch.setenv("HSCAP_DIR", str(tmp_path / "dump"))
    monkeypatch.syspath_prepend(HOOK)
    code, f = in_process(("--model-path", "m") + flags if flags else ())
    if status is None:
        assert topic not in f and code == 0
        return
    assert f[topic].status == status
    assert code == (1 if status == "block" else 0)
    if topic == "scheduler":
        assert "overlap" in f[topic].detail and "on" in f["decode CUDA graphs"].detail
    if status in ("block", "warn"):
        assert f[topic].action


def test_a_shadowed_hook_or_no_dump_dir_blocks(doctored):
    code, f = doctored[0]["shadowed"]
    assert code == 1 and f["sitecustomize"]["status"] == "block" and "shadows the hook" in f["sitecustomize"]["detail"]
    code, f = doctored[0]["no hook"]
    assert code == 1 and f["sitecustomize"]["status"] == "block" and "PYTHONPATH" in f["sitecustomize"]["action"]
    code, f = doctored[0]["no dump dir"]
    assert code == 1 and f["settings"]["status"] == "block" and "HSCAP_DIR" in f["settings"]["detail"]


def _checkpoint(tmp_path, name, arch):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
    return str(d)


@pytest.mark.parametrize("arch,family", [  # a class of its own, and one covered through another
    ("Qwen3MoeForCausalLM", "qwen3_moe"), ("KimiK25ForConditionalGeneration", "deepseek"),
])
def test_every_family_is_found_and_the_served_model_is_judged(tmp_path, monkeypatch, arch, family):
    monkeypatch.setenv("HSCAP_DIR", str(tmp_path / "dump"))
    monkeypatch.syspath_prepend(HOOK)
    code, f = in_process(("--model-path", _checkpoint(tmp_path, "m", arch), "--disable-cuda-graph",
                          "--disable-radix-cache"))
    assert code == 0, {k: v for k, v in f.items() if v.status == "block"}
    for target in ("DeepseekV2ForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert f[f"target {target}"].status == "ok", f[f"target {target}"]
    assert "layer_flags selection" in f["target Qwen3MoeForCausalLM"].detail
    assert f["model"].status == "ok" and f"the {family} target" in f["model"].detail


def test_a_model_no_target_captures_blocks(doctored):
    code, f = doctored[0]["no target"]
    assert code == 1
    assert f["model"]["status"] == "block" and "GPT2LMHeadModel is not a target" in f["model"]["detail"]
    assert "LlamaForCausalLM" in f["model"]["action"]


def test_the_pre_norm_state_speculators_needs_is_named_before_serving(tmp_path):
    from hs_capture.server.doctor import check_settings

    without = {f.topic: f for f in check_settings({"HSCAP_DIR": str(tmp_path)})}
    assert without["pre-norm state"].status == "info" and "HSCAP_PRENORM=1" in without["pre-norm state"].action
    assert "pre-norm state" not in {f.topic for f in check_settings({"HSCAP_DIR": str(tmp_path), "HSCAP_PRENORM": "1"})}


def test_hscap_serve_says_when_the_pre_norm_state_is_not_captured(tmp_path):
    from click.testing import CliRunner

    from hs_capture.cli import main

    res = CliRunner().invoke(main, ["serve", "-d", str(tmp_path), "--dry-run", "--", "--model-path", "m"])
    assert res.exit_code == 0 and "add --prenorm" in res.output
    res = CliRunner().invoke(main, ["serve", "-d", str(tmp_path), "--prenorm", "--dry-run", "--", "--model-path", "m"])
    assert res.exit_code == 0 and "add --prenorm" not in res.output


def test_doctor_reports_the_writer_threads_the_server_will_use_and_blocks_a_bad_layer_set(tmp_path, monkeypatch):
    from hs_capture.server import config

    monkeypatch.setenv("HSCAP_DIR", str(tmp_path / "dump"))
    monkeypatch.syspath_prepend(HOOK)
    monkeypatch.setattr(config, "usable_cores", lambda: 16)  # a 16-core host
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 6}))
    flags = ("--model-path", str(model), "--disable-cuda-graph", "--disable-radix-cache")
    _, f = in_process(flags)
    assert "12 (auto) writer threads per writing rank, 1 writing rank(s) on this host, each in a writer process of " \
           "its own" in f["settings"].detail
    # DP attention: one writer per DP group, all on this host, sharing its cores (as capture.py decides)
    _, f = in_process(flags + ("--tp", "4", "--dp", "4", "--enable-dp-attention"))
    assert "3 (auto) writer threads per writing rank, 4 writing rank(s) on this host" in f["settings"].detail
    monkeypatch.setenv("HSCAP_LAYERS", "2,9")
    code, f = in_process(flags)
    assert code == 1 and f["settings"].status == "block" and "outside 1..5" in f["settings"].detail
    assert not (tmp_path / "dump").exists()  # a check creates nothing


@pytest.mark.parametrize("ids", [[1, 2, 4], [2, 3, 4], None])
def test_a_speculating_server_names_both_layer_sets(tmp_path, monkeypatch, ids):
    """The drafter's layers are what SGLang's own set_eagle3_layers_to_capture makes of its
    config's ids (run here on the installed release); the hook's are HSCAP_LAYERS."""
    from tests.sglang_cpu.eagle_ids_probe import layers_for

    monkeypatch.setenv("HSCAP_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv("HSCAP_LAYERS", "1,4")
    monkeypatch.syspath_prepend(HOOK)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 6}))
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"],
                                                   **({"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}}
                                                      if ids else {})}))
    code, f = in_process(("--model-path", str(model), "--disable-cuda-graph", "--disable-radix-cache",
                          "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft)))
    served = layers_for("deepseek_v3", ids, 6)  # ids None: the release's default
    detail = f["speculative decoding"].detail
    assert code == 0 and f["speculative decoding"].status == "info", detail
    assert f"the drafter gets layers {served}" in detail and "the hook captures layers [1, 4]" in detail
    assert "never captured" in detail
    # a drafter that is not local: its layers are named once the server loads it
    _, f = in_process(("--model-path", str(model), "--disable-cuda-graph", "--speculative-algorithm", "EAGLE3",
                       "--speculative-draft-model-path", "org/remote-draft"))
    assert "the server log names them" in f["speculative decoding"].detail


def test_doctor_says_which_capture_policy_runs_and_what_the_radix_cache_does(tmp_path, monkeypatch):
    monkeypatch.setenv("HSCAP_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv("HSCAP_CAPTURE_FRACTION", "0.05")
    monkeypatch.syspath_prepend(HOOK)
    code, f = in_process(("--model-path", "m", "--disable-cuda-graph"))
    assert f["capture policy"].status == "ok"
    assert f["capture policy"].detail.startswith("0.05 of requests by rid hash and requests marked extra_key=hscap*")
    assert f["radix cache"].status == "ok" and "namespace of its own" in f["radix cache"].detail
    monkeypatch.setenv("HSCAP_CACHE_NAMESPACE", "0")
    code, f = in_process(("--model-path", "m", "--disable-cuda-graph"))
    assert f["radix cache"].status == "warn" and "reported incomplete" in f["radix cache"].detail
    monkeypatch.setenv("HSCAP_REUSE_CAPTURED", "1")
    monkeypatch.setenv("HSCAP_FOLLOW", "1")
    code, f = in_process(("--model-path", "m", "--disable-cuda-graph"))
    assert f["radix cache"].status == "ok" and "reuse only prefixes captured requests computed" in f["radix cache"].detail
    assert f["capture policy"].detail.startswith("0.05 of requests by rid hash and requests marked extra_key=hscap* "
                                                 "and the requests that continue a captured prompt")
    monkeypatch.delenv("HSCAP_REUSE_CAPTURED")
    monkeypatch.delenv("HSCAP_FOLLOW")
    monkeypatch.setenv("HSCAP_CAPTURE_FRACTION", "1.5")
    code, f = in_process(("--model-path", "m", "--disable-cuda-graph"))
    assert code == 1 and f["settings"].detail == "HSCAP_CAPTURE_FRACTION=1.5 is outside [0, 1]"


def test_hscap_serve_keeps_the_radix_cache_and_sets_the_fraction_when_asked(tmp_path):
    from click.testing import CliRunner

    from hs_capture.cli import main

    base = ["serve", "-d", str(tmp_path), "--prenorm", "--python", "/bin/true", "--dry-run"]
    res = CliRunner().invoke(main, [*base, "--", "--model-path", "m"])
    assert res.exit_code == 0 and "--disable-radix-cache" in res.output and "HSCAP_CAPTURE_FRACTION" not in res.output
    res = CliRunner().invoke(main, [*base, "--fraction", "0.05", "--keep-radix-cache", "--", "--model-path", "m"])
    assert res.exit_code == 0 and "--disable-radix-cache" not in res.output
    assert res.output.startswith("HSCAP_CAPTURE_FRACTION=0.05 HSCAP_DIR=") and "HSCAP_PRENORM=1" in res.output
    res = CliRunner().invoke(main, [*base, "--fraction", "0.05", "--follow", "--", "--model-path", "m"])
    assert res.exit_code == 0 and "--disable-radix-cache" not in res.output  # --follow keeps the cache
    assert "HSCAP_FOLLOW=1" in res.output and "HSCAP_REUSE_CAPTURED=1" in res.output
    res = CliRunner().invoke(main, [*base, "--fraction", "2", "--", "--model-path", "m"])
    assert res.exit_code == 2 and "2.0 is not in the range 0.0<=x<=1.0" in res.output
