"""The hooks against the REAL sglang installed in the test venv: what gets wrapped, the
instrument/uninstrument round trip, and the bootstrap in fresh interpreters."""

import inspect
import json
import os
import subprocess
import sys
import traceback
import types

import pytest
import torch

from hs_capture.dump.paths import part_name
import wrapt

from hs_capture.server.instrumentor import is_wrapped
from tests.sglang_cpu.harness import REPO, SHIMS

sys.path.insert(0, SHIMS)  # the import-only vllm stand-in SGLang needs on a CPU machine


@pytest.fixture(scope="module")
def dsv2():
    import sglang.srt.models.deepseek_v2 as m

    return m


@pytest.fixture
def instrumented(dsv2, clean_env):
    from hs_capture.server.instrumentor import HsCaptureInstrumentor

    inst = HsCaptureInstrumentor()
    assert inst.instrument()
    yield inst
    if inst.is_instrumented:
        inst.uninstrument()


class _ConfigRead(Exception):
    """Raised by the first attribute SGLang's __init__ reads off its config: it stops there."""


class _StopAtConfig:
    def __getattr__(self, name):
        raise _ConfigRead(name)


def _hook_frames(cls, module):
    """Build `cls` until SGLang's __init__ (in `module`) reads its config; how many frames of
    hs_capture's instrumentor the call went through on the way."""
    from hs_capture.server import instrumentor as instrumentor_mod

    with pytest.raises(_ConfigRead) as raised:
        cls(_StopAtConfig())
    frames = traceback.extract_tb(raised.tb)[:-1]  # less _StopAtConfig.__getattr__
    assert frames[-1].name == "__init__" and frames[-1].filename == inspect.getsourcefile(module)
    return sum(f.filename == instrumentor_mod.__file__ for f in frames)


def test_wraps_the_defining_classes_once(dsv2, instrumented):
    from hs_capture.server.instrumentor import is_ours

    init, forward = vars(dsv2.DeepseekV2ForCausalLM)["__init__"], vars(dsv2.DeepseekV2Model)["forward"]
    for proxy, own in ((init, "DeepseekV2ForCausalLM.__init__"), (forward, "DeepseekV2Model.forward")):
        # ours (uninstrument finds it), one layer deep, around SGLang's own function
        assert is_ours(proxy) and not is_wrapped(proxy.__wrapped__) and proxy.__wrapped__.__qualname__ == own
    # the forward of a model being captured goes to its capture state, once, with SGLang's forward
    calls = []

    class State:
        def forward(self, wrapped, instance, args, kwargs):
            calls.append((wrapped, instance, args, kwargs))
            return "captured"

    model = object.__new__(dsv2.DeepseekV2Model)  # no __init__: nothing of SGLang's runs
    model.__dict__["_hscap_state"] = State()
    assert model.forward("ids", "positions", forward_batch="batch") == "captured"
    ((wrapped, instance, args, kwargs),) = calls
    assert instance is model and args == ("ids", "positions") and kwargs == {"forward_batch": "batch"}
    assert not is_wrapped(wrapped) and wrapped.__func__ is forward.__wrapped__
    # Kimi-K2's class inherits the wrapped __init__: no second wrapper on the subclass, and
    # building one goes through the hook once, into DeepseekV2ForCausalLM's own __init__
    for sub in (dsv2.DeepseekV3ForCausalLM, dsv2.DeepseekV32ForCausalLM):
        assert "__init__" not in vars(sub)
        owner = next(k for k in sub.__mro__ if "__init__" in vars(k))
        assert owner is dsv2.DeepseekV2ForCausalLM
    for cls in (dsv2.DeepseekV2ForCausalLM, dsv2.DeepseekV3ForCausalLM, dsv2.DeepseekV32ForCausalLM):
        assert _hook_frames(cls, dsv2) == 1, cls


def test_every_family_is_wrapped_on_its_defining_classes_and_unwrapped_again(clean_env):
    import importlib

    from hs_capture.server.instrumentor import HsCaptureInstrumentor, is_ours
    from hs_capture.server.targets import TARGETS

    def owner(cls, attr):
        return next(k for k in cls.__mro__ if attr in vars(k))

    mods = {t: importlib.import_module(t.module) for t in TARGETS}
    slots = [(owner(getattr(mods[t], name), attr), attr) for t in TARGETS
             for name, attr in ((t.causal_lm, "__init__"), (t.model, "forward"))]
    originals = {slot: vars(slot[0])[slot[1]] for slot in slots}
    inst = HsCaptureInstrumentor()
    assert inst.instrument()
    try:
        for klass, attr in slots:
            current = vars(klass)[attr]
            assert is_ours(current) and not is_wrapped(current.__wrapped__), (klass, attr)
        # Qwen3-MoE's forward is Qwen2MoeModel's: wrapped where it is defined
        assert owner(mods[TARGETS[-1]].Qwen3MoeModel, "forward").__name__ == "Qwen2MoeModel"
    finally:
        inst.uninstrument()
    for (klass, attr), original in originals.items():
        assert vars(klass)[attr] is original


def test_repeat_instrument_warns_and_stacks_nothing(dsv2, instrumented):
    before = vars(dsv2.DeepseekV2Model)["forward"]
    assert instrumented.instrument() is False
    assert vars(dsv2.DeepseekV2Model)["forward"] is before
    assert not is_wrapped(before.__wrapped__)


def test_uninstrument_restores_the_originals_and_reinstrument_works(dsv2, instrumented):
    wrapped_forward = vars(dsv2.DeepseekV2Model)["forward"]
    original = wrapped_forward.__wrapped__
    instrumented.uninstrument()
    assert vars(dsv2.DeepseekV2Model)["forward"] is original
    assert not is_wrapped(vars(dsv2.DeepseekV2ForCausalLM)["__init__"])
    instrumented.uninstrument()  # a no-op with a warning
    assert instrumented.instrument()
    assert vars(dsv2.DeepseekV2Model)["forward"].__wrapped__ is original


def test_a_foreign_wrapper_is_left_alone(dsv2, clean_env):
    from hs_capture.server.instrumentor import HsCaptureInstrumentor

    inst = HsCaptureInstrumentor()
    original = vars(dsv2.DeepseekV2Model)["forward"]
    foreign = wrapt.FunctionWrapper(original, lambda w, i, a, k: w(*a, **k))
    dsv2.DeepseekV2Model.forward = foreign
    try:
        inst.instrument()
        assert vars(dsv2.DeepseekV2Model)["forward"] is foreign
        inst.uninstrument()
        assert vars(dsv2.DeepseekV2Model)["forward"] is foreign
    finally:
        dsv2.DeepseekV2Model.forward = original


# ------------------------------------------------------------------ forward logic
def _sglang_like_forward(model, hidden_size=4, num_layers=6, tokens=3):
    """DeepseekV2Model.forward's capture contract, with SGLang's real AuxHiddenStatePacker:
    layer i's input is captured when i is in layers_to_capture, packed in layer order."""
    from sglang.srt.layers.aux_hidden_states import AuxHiddenStatePacker

    def forward(input_ids, positions, forward_batch):
        packer = AuxHiddenStatePacker(len(model.layers_to_capture))
        for i in range(num_layers):
            if i in model.layers_to_capture:
                packer.append(torch.full((tokens, hidden_size), float(i)))
        final = torch.full((tokens, hidden_size), -1.0)
        return final if len(packer) == 0 else (final, packer.finalize())

    return forward


class _Writer:
    """Records what would be written (the real writer is tested in test_writer.py)."""

    rank = types.SimpleNamespace(tag="dp0-tp0-pp0")
    stopped = None  # ShardWriter.stopped: set when a full disk stops capture

    def __init__(self):
        from hs_capture.server.forward_cost import ForwardCost

        self.steps = []
        self.cost = ForwardCost()

    def submit(self, meta, tensors, aux_layers):
        self.steps.append((meta, {k: v.clone() for k, v in tensors.items()}, aux_layers))
        return True


def _batch(mode="EXTEND", tokens=3):
    return types.SimpleNamespace(
        forward_mode=types.SimpleNamespace(name=mode), extend_seq_lens_cpu=[tokens],
        extend_prefix_lens_cpu=[0], rids=["r"], input_ids=torch.arange(tokens), positions=torch.arange(tokens))


def _capture(host_layers=(), host_flag=False, store="lossless"):
    from hs_capture.server.capture import ModelCapture

    parent, model = torch.nn.Module(), torch.nn.Module()  # weak-referenceable, like the real ones
    parent.capture_aux_hidden_states = host_flag
    model.layers_to_capture = list(host_layers)
    writer = _Writer()
    state = ModelCapture([1, 3], sorted(host_layers), 4, writer, parent, store=store)
    state.layers_for(model, capturing=True)
    parent.capture_aux_hidden_states = True  # what setup_model does
    return state, model, parent, writer


def test_plain_server_gets_a_bare_aux_none_and_we_get_our_layers():
    state, model, parent, writer = _capture()
    out = state.forward(_sglang_like_forward(model), model, (None, None, _batch()), {})
    assert isinstance(out, tuple) and out[1] is None and torch.equal(out[0], torch.full((3, 4), -1.0))
    meta, tensors, aux_layers = writer.steps[0]
    assert aux_layers == [1, 3] and tensors["aux"][0].tolist() == [1.0] * 4 + [3.0] * 4


def test_the_compact_tier_hands_the_writer_fp8_states_and_their_scales():
    state, model, parent, writer = _capture(store="fp8")
    out = state.forward(_sglang_like_forward(model), model, (None, None, _batch()), {})
    assert torch.equal(out[0], torch.full((3, 4), -1.0))  # the forward's own output untouched
    meta, tensors, aux_layers = writer.steps[0]
    assert meta.dtype == "float8_e4m3fn" and aux_layers == []  # aux cut into its layers on the way
    assert {k for k, t in tensors.items() if t.dtype == torch.float8_e4m3fn} == {"L01", "L03", "final"}
    assert tensors["L03"].float().mul(tensors["L03#scale"][:, None]).tolist() == [[3.0] * 4] * 3
    assert writer.cost.seconds["quantize"] > 0  # the forward's time on it, reported by cause


def test_decode_steps_capture_nothing_and_cost_no_aux():
    state, model, parent, writer = _capture()
    out = state.forward(_sglang_like_forward(model), model, (None, None, _batch("DECODE")), {})
    assert model.layers_to_capture == [] and out[1] is None and not writer.steps


def test_after_a_stop_prefills_run_bare_and_capture_nothing():
    """A full disk stopped the writer: the forward goes back to the host's own layers."""
    state, model, parent, writer = _capture()
    writer.stopped = {"reason": "disk full", "step": 0, "time": 0.0}
    out = state.forward(_sglang_like_forward(model), model, (None, None, _batch("EXTEND")), {})
    assert model.layers_to_capture == [] and out[1] is None and not writer.steps


@pytest.mark.parametrize("host_layers", [[2, 3, 5], [1, 3]])
def test_sglang_eagle3_still_gets_exactly_its_layers(host_layers):
    """A server really running EAGLE-3 (set_eagle3_layers_to_capture after us) is unaffected."""
    state, model, parent, writer = _capture()
    model.layers_to_capture = list(host_layers)  # what set_eagle3_layers_to_capture does
    parent.capture_aux_hidden_states = True
    for mode in ("EXTEND", "DECODE", "TARGET_VERIFY"):
        out = state.forward(_sglang_like_forward(model), model, (None, None, _batch(mode)), {})
        expect = torch.cat([torch.full((3, 4), float(i)) for i in host_layers], dim=-1)
        assert torch.equal(out[1], expect), mode
    assert len(writer.steps) == 1  # only the prefill was captured
    _, tensors, aux_layers = writer.steps[0]
    # each stored block labelled as the writer will label it: by the layers handed to it
    got = {k: v[0, 0].item() for k, v in tensors.items() if k.startswith("L")}
    if "aux" in tensors:
        got.update({part_name(layer): tensors["aux"][0, j * 4].item() for j, layer in enumerate(aux_layers)})
    assert got == {"L01": 1.0, "L03": 3.0}


@pytest.mark.parametrize("fault", ["submit", "layer bookkeeping"])
def test_capture_errors_never_reach_the_forward(monkeypatch, fault):
    """The writer failing, or our layer bookkeeping failing on what the host left in
    layers_to_capture: the forward returns what the host would get, the error is counted and
    logged, and the next prefill (the fault gone) is captured as before."""
    from hs_capture.server import capture as capture_mod

    logged = []
    monkeypatch.setattr(capture_mod.log, "error", lambda msg, *a: logged.append(msg % a))
    state, model, parent, writer = _capture()
    if fault == "submit":
        def broken_submit(*a, **k):
            raise RuntimeError("disk on fire")

        writer.submit = broken_submit
    else:
        model.layers_to_capture = ["not a layer"]  # a new host list our sorting cannot take
    out = state.forward(_sglang_like_forward(model), model, (None, None, _batch()), {})
    assert isinstance(out, tuple) and torch.equal(out[0], torch.full((3, 4), -1.0)) and out[1] is None
    assert state.errors == 1 and not writer.steps
    what = "capture failed (1 so far), serving continues: RuntimeError: disk on fire" if fault == "submit" else \
        "layer bookkeeping failed (1 so far), serving continues: TypeError"
    assert len(logged) == 1 and logged[0].startswith(what), logged
    if fault == "submit":
        del writer.submit
    else:
        model.layers_to_capture = []  # the host's next list: nothing of its own
    out = state.forward(_sglang_like_forward(model), model, (None, None, _batch()), {})
    assert out[1] is None and state.errors == 1 and len(writer.steps) == 1
    _, tensors, aux_layers = writer.steps[0]
    assert aux_layers == [1, 3] and tensors["aux"][0].tolist() == [1.0] * 4 + [3.0] * 4


# ------------------------------------------------------------------ bootstrap, fresh interpreters
PROBE = r"""
import json, sys, os
res = {"user_site": getattr(sys.modules.get("sitecustomize"), "USER_MARK", None),
       "loaded": getattr(sys.modules.get("hs_capture_sitecustomize"), "loaded", None),
       "run_id": os.environ.get("HSCAP_RUN_ID"),
       "wrapt_loaded": "wrapt" in sys.modules, "torch_loaded": "torch" in sys.modules}
if len(sys.argv) > 1:
    sys.path.insert(0, sys.argv[1])
    import sglang.srt.models.deepseek_v2 as m
    from hs_capture.server.instrumentor import is_wrapped
    res["forward_wrapped"] = is_wrapped(vars(m.DeepseekV2Model)["forward"])
    res["init_wrapped"] = is_wrapped(vars(m.DeepseekV2ForCausalLM)["__init__"])
print("RESULT " + json.dumps(res))
"""


def _probe_command(tmp_path, hook_dir, env_extra, import_sglang=False):
    user = tmp_path / "user_site"
    user.mkdir(exist_ok=True)
    (user / "sitecustomize.py").write_text("USER_MARK = 'user sitecustomize ran'\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HSCAP_", "SGLANG_HS_", "PYTHON"))}
    env["PYTHONPATH"] = os.pathsep.join([hook_dir, str(user)])
    env.update(env_extra)
    return [sys.executable, "-c", PROBE] + ([SHIMS] if import_sglang else []), env


def _probe_result(out):
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[7:]), out.stderr


def _probe(tmp_path, hook_dir, env_extra, import_sglang=False):
    args, env = _probe_command(tmp_path, hook_dir, env_extra, import_sglang)
    return _probe_result(subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300))


def _run_at_once(commands: dict, root) -> dict:
    """name -> (args, env): each in a fresh interpreter, all started at once (output to files:
    a full pipe would stop one not read yet); name -> CompletedProcess."""
    procs = {}
    try:
        for k, (name, (args, env)) in enumerate(commands.items()):
            with open(root / f"{k}.out", "w") as out, open(root / f"{k}.err", "w") as err:
                procs[name] = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=err,
                                               stdin=subprocess.DEVNULL)
        done = {}
        for k, (name, p) in enumerate(procs.items()):
            try:
                p.wait(timeout=300)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            done[name] = subprocess.CompletedProcess(p.args, p.returncode, (root / f"{k}.out").read_text(),
                                                     (root / f"{k}.err").read_text())
        return done
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def sglang_imported(tmp_path_factory):
    """The three fresh interpreters below that import SGLang's model code (~20 s of one core
    each here), started at once: the machine's other core idled while each ran alone. Each
    has a dir of its own (its user sitecustomize, its HSCAP_DIR)."""
    root = tmp_path_factory.mktemp("sglang-imported")
    dirs = {name: root / name.replace(" ", "-") for name in ("enabled", "imported first", "cannot load")}
    for d in dirs.values():
        d.mkdir()
    return _run_at_once({
        "enabled": _probe_command(dirs["enabled"], "hs_capture/sitecustomize",
                                  {"HSCAP_DIR": str(dirs["enabled"] / "d")}, import_sglang=True),
        "imported first": _capture_on_command(IMPORTED_FIRST, dirs["imported first"]),
        "cannot load": _capture_on_command(CANNOT_LOAD, dirs["cannot load"]),
    }, root)


def test_inert_without_hscap_dir_and_chains_to_the_user_sitecustomize(tmp_path):
    res, err = _probe(tmp_path, "hs_capture/sitecustomize", {})
    assert res == {"user_site": "user sitecustomize ran", "loaded": True, "run_id": None,
                   "wrapt_loaded": False, "torch_loaded": False}
    assert "HS_DUMP" not in err


def test_enabled_hooks_the_real_sglang_classes_on_import(sglang_imported):
    res, err = _probe_result(sglang_imported["enabled"])
    assert res["user_site"] == "user sitecustomize ran" and res["loaded"] is True
    assert res["run_id"].startswith("run-") and res["torch_loaded"] is False  # lazy: nothing heavy at start
    assert res["forward_wrapped"] and res["init_wrapped"]
    assert "[HS_DUMP] hooks installed on sglang.srt.models.deepseek_v2" in err


def test_top_level_sitecustomize_dir_and_installed_path_are_the_same_hook(tmp_path):
    installed = subprocess.run([sys.executable, "-m", "hs_capture.cli", "pythonpath"], capture_output=True,
                               text=True, cwd=str(tmp_path), check=True).stdout.strip()
    assert os.path.samefile(os.path.join(installed, "sitecustomize.py"),
                            os.path.join(REPO, "hs_capture", "sitecustomize", "sitecustomize.py"))
    assert os.path.realpath(os.path.join(REPO, "sitecustomize", "sitecustomize.py")) == \
        os.path.realpath(os.path.join(installed, "sitecustomize.py"))
    for hook_dir in ("sitecustomize", installed):
        res, _ = _probe(tmp_path, hook_dir, {"HSCAP_DIR": str(tmp_path / "d")})
        assert res["loaded"] is True and res["run_id"] and res["user_site"] == "user sitecustomize ran"


IMPORTED_FIRST = (f"import sys; sys.path.insert(0, {SHIMS!r}); import sglang.srt.models.deepseek_v2 as m\n"
                  "from hs_capture.server import bootstrap\nfrom hs_capture.server.instrumentor import is_wrapped\n"
                  "assert not is_wrapped(vars(m.DeepseekV2Model)['forward'])\n"
                  "assert bootstrap.run()\n"
                  "assert is_wrapped(vars(m.DeepseekV2Model)['forward'])\nprint('OK')\n")


def test_hooks_apply_when_sglang_was_imported_first(sglang_imported):
    out = sglang_imported["imported first"]
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]


def _capture_on_command(code: str, tmp_path):
    """`python -c code` for a fresh process with HSCAP_DIR set and no hook on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HSCAP_", "PYTHONPATH"))}
    env["HSCAP_DIR"] = str(tmp_path / "d")
    return [sys.executable, "-c", code], env


def test_a_broken_bootstrap_never_breaks_the_host(tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "wrapt.py").write_text("raise ImportError('wrapt is broken in this image')\n")
    res, err = _probe(tmp_path, os.pathsep.join(["hs_capture/sitecustomize", str(broken)]),
                      {"HSCAP_DIR": str(tmp_path / "d")})
    assert res["loaded"] is False and res["user_site"] == "user sitecustomize ran"
    assert "[HS_DUMP] ERROR: bootstrap failed, capture is OFF: ImportError: wrapt is broken" in err


def test_a_pip_installed_copy_ships_the_hook(tmp_path):
    """A real (non-editable) install: the hook dir that `hscap pythonpath` prints works."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), REPO], check=True, capture_output=True, timeout=300)
    hook_dir = target / "hs_capture" / "sitecustomize"
    assert (hook_dir / "sitecustomize.py").is_file() and not (hook_dir / "sitecustomize.py").is_symlink()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HSCAP_", "PYTHON"))}
    env["PYTHONPATH"] = str(target)
    printed = subprocess.run([sys.executable, "-m", "hs_capture.cli", "pythonpath"], env=env, cwd=str(tmp_path),
                             capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.samefile(printed, hook_dir)
    res, _ = _probe(tmp_path, str(hook_dir), {"HSCAP_DIR": str(tmp_path / "d")})
    assert res["loaded"] is True and res["run_id"] and res["user_site"] == "user sitecustomize ran"


def _flag_forward(model, hidden_size=4, tokens=3):
    """Qwen2MoeModel.forward's contract (Qwen3-MoE): a layer's input is captured when that
    layer carries `_is_layer_to_capture`; the list attribute is not read."""

    def forward(input_ids, positions, forward_batch):
        aux = [torch.full((tokens, hidden_size), float(i)) for i, layer in enumerate(model.layers)
               if getattr(layer, "_is_layer_to_capture", False)]
        final = torch.full((tokens, hidden_size), -1.0)
        return (final, aux) if aux else final

    return forward


def test_layer_flag_families_are_told_through_their_layers_and_the_host_keeps_its_own():
    from hs_capture.server.capture import ModelCapture
    from hs_capture.server.targets import LAYER_FLAGS

    parent, model = torch.nn.Module(), torch.nn.Module()
    parent.capture_aux_hidden_states = False
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(6))
    model.layers_to_capture = []
    writer = _Writer()
    state = ModelCapture([1, 3], [], 4, writer, parent, LAYER_FLAGS)
    parent.capture_aux_hidden_states = True

    def flagged():
        return [i for i, layer in enumerate(model.layers) if getattr(layer, "_is_layer_to_capture", False)]

    out = state.forward(_flag_forward(model), model, (None, None, _batch()), {})
    assert flagged() == [1, 3] and out[1] is None
    tensors = writer.steps[0][1]
    assert tensors["L01"][0, 0] == 1.0 and tensors["L03"][0, 0] == 3.0
    state.forward(_flag_forward(model), model, (None, None, _batch("DECODE")), {})
    assert flagged() == [] and len(writer.steps) == 1
    # SGLang's own EAGLE-3 (Qwen2MoeModel.set_eagle3_layers_to_capture): a new list, its flags
    model.layers_to_capture = [2]
    model.layers[2]._is_layer_to_capture = True
    out = state.forward(_flag_forward(model), model, (None, None, _batch()), {})
    assert flagged() == [1, 2, 3] and [a[0, 0].item() for a in out[1]] == [2.0]
    tensors = writer.steps[1][1]
    assert sorted(tensors) == ["L01", "L03", "final", "positions", "tokens"] and tensors["L03"][0, 0] == 3.0
    state.forward(_flag_forward(model), model, (None, None, _batch("DECODE")), {})
    assert flagged() == [2]
    state.restore(model)
    assert flagged() == [2] and model.layers_to_capture == [2]


CANNOT_LOAD = (f"import sys; sys.path.insert(0, {SHIMS!r})\n"
               "from hs_capture.server import bootstrap\nassert bootstrap.run()\n"
               "sys.modules['hs_capture.server.instrumentor'] = None  # as a broken install would: ImportError\n"
               "import sglang.srt.models.deepseek_v2 as m\nprint('OK', m.DeepseekV2Model.__name__)\n")


def test_a_hook_that_cannot_load_leaves_capture_off_and_the_server_importing(sglang_imported):
    """A hook raising in a post-import hook would fail SGLang's own import of the model module."""
    out = sglang_imported["cannot load"]
    assert out.returncode == 0 and "OK DeepseekV2Model" in out.stdout, out.stderr[-2000:]
    assert "[HS_DUMP] ERROR: capture is OFF in this process: the hook cannot load: ModuleNotFoundError" in out.stderr
