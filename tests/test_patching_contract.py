"""One patching design (hs_capture.patching) and its contract, over every trainer patch and the
server's hooks: a second instrument() changes nothing, someone else's wrapper on a point is
refused and said so, uninstrument() puts back the very objects that were there
(tests/patching_contract.py). A trainer whose code this venv cannot import runs the contract in
its own venv (.venvs/NAME) where there is one, else it is skipped with the reason. Then the base
itself on a planted module: wrapping where the attribute is defined, a second binding of a
wrapped function, hooks that do nothing once uninstrumented, a failed instrument undone."""

import json
import os
import subprocess
import sys

import pytest
import wrapt

from hs_capture.offline.train.trainers import NAMES, load
from hs_capture.offline.train.trainers.patching import Point, TrainerPatch, Unsupported
from hs_capture.patching import REFUSED, SHARED, WRAPPED, Instrumentor, defining_class, is_ours, owner_of
from tests import patching_contract as contract
from tests.sglang_cpu.harness import REPO, SHIMS


@pytest.mark.parametrize("name", NAMES)
def test_every_trainer_patch_keeps_the_contract(name):
    problem = load(name).check()
    if problem is None:
        contract.trainer_contract(name)
        return
    python = os.path.join(REPO, ".venvs", name, "bin", "python")
    if not os.path.exists(python):
        pytest.skip(f"{name}: {problem} (and no .venvs/{name})")
    p = subprocess.run([python, os.path.join(REPO, "tests", "patching_contract.py"), name], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": REPO}, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got == {"ok": True}, got.get("error")


def test_the_server_instrumentor_keeps_the_contract(clean_env):
    import importlib

    sys.path.insert(0, SHIMS)  # the import-only stand-ins SGLang needs on a CPU machine
    from hs_capture.server import targets
    from hs_capture.server.instrumentor import HsCaptureInstrumentor

    places = []
    wanted = [(t.module, t.causal_lm, "__init__") for t in targets.TARGETS]
    wanted += [(t.module, t.model, "forward") for t in targets.TARGETS]
    requests = getattr(targets, "REQUESTS", None)  # SGLang's request class, where the server wraps it
    if requests is not None:
        wanted.append((requests.module, requests.cls, "__init__"))
    for module, cls, attr in wanted:
        place = (defining_class(getattr(importlib.import_module(module), cls), attr), attr)
        if place not in places:
            places.append(place)
    inst = HsCaptureInstrumentor()
    if inst.is_instrumented:
        inst.uninstrument()
    instrument = lambda i: i.instrument()  # noqa: E731
    contract.instrument_twice_changes_nothing(HsCaptureInstrumentor, places, instrument)
    contract.uninstrument_restores_the_originals(HsCaptureInstrumentor, places, instrument)
    # inside SGLang a refusal is a warning: capture goes on where it can, the host never breaks
    contract.refuses_to_stack(HsCaptureInstrumentor, places, instrument, contract.logged("hs_capture"), stops=False)


# ------------------------------------------------------------------ the base, on a planted module
PLANTED = """
class Base:
    def run(self, x):
        return ("run", x)

class Child(Base):
    pass

def helper(x):
    return ("helper", x)
"""


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """new(name) -> a fresh module `name` of PLANTED's source, importable from tmp_path."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def new(name: str) -> str:
        (tmp_path / f"{name}.py").write_text(PLANTED)
        names.append(name)
        return name

    yield new
    for name in names:
        sys.modules.pop(name, None)


class Toy(Instrumentor):
    def __init__(self, module: str) -> None:
        super().__init__()
        self.module, self.calls = module, []

    def _instrument(self, fail: bool = False) -> None:
        self.when_imported(self.module, self._on_import)
        if fail:
            raise RuntimeError("half way")

    def _on_import(self, module):
        self.outcomes = [self.wrap(module.Child, "run", self._record), self.wrap(module, "helper", self._record)]

    def _record(self, wrapped, instance, args, kwargs):
        self.calls.append(args)
        return wrapped(*args, **kwargs)


def test_wrap_goes_where_the_attribute_is_defined_and_passes_through_once_uninstrumented(planted):
    import importlib

    mod = importlib.import_module(planted("toy_defined"))
    run, helper = vars(mod.Base)["run"], mod.helper
    toy = Toy("toy_defined")
    assert toy.instrument()
    assert toy.outcomes == [WRAPPED, WRAPPED] and "run" not in vars(mod.Child)
    assert owner_of(vars(mod.Base)["run"]) is toy and [s.original for s in toy.slots] == [run, helper]
    assert mod.Child().run(1) == ("run", 1) and mod.helper(2) == ("helper", 2) and toy.calls == [(1,), (2,)]
    kept = mod.helper  # a binding taken while instrumented (`from toy import helper`)
    assert toy.uninstrument()
    assert vars(mod.Base)["run"] is run and mod.helper is helper
    assert kept(3) == ("helper", 3) and toy.calls == [(1,), (2,)]  # inert now


def test_a_module_imported_after_instrument_is_patched_and_not_once_uninstrumented(planted):
    import importlib

    toy = Toy(planted("toy_later"))
    assert toy.instrument()
    mod = importlib.import_module("toy_later")
    assert is_ours(vars(mod.Base)["run"])
    toy.uninstrument()
    sys.modules.pop("toy_later")
    fresh = importlib.import_module("toy_later")  # the hook is still registered with wrapt: it does nothing
    assert not isinstance(vars(fresh.Base)["run"], wrapt.FunctionWrapper) and not toy.slots


def test_a_second_binding_of_a_wrapped_function_is_put_back_as_the_function(planted):
    import importlib
    import types

    mod = importlib.import_module(planted("toy_binding"))
    helper = mod.helper
    toy = Toy("toy_binding")
    toy.instrument()
    other = types.ModuleType("toy_other")
    other.helper = mod.helper  # `from toy_binding import helper`, run after the wrap
    assert toy.wrap(other, "helper", toy._record) == SHARED and other.helper is mod.helper
    toy.uninstrument()
    assert other.helper is helper and mod.helper is helper


def test_a_failed_instrument_is_undone_and_a_foreign_or_replaced_wrapper_is_left(planted):
    import importlib

    mod = importlib.import_module(planted("toy_undone"))
    run, helper = vars(mod.Base)["run"], mod.helper
    toy = Toy("toy_undone")
    with pytest.raises(RuntimeError, match="half way"):
        toy.instrument(fail=True)
    assert not toy.is_instrumented and vars(mod.Base)["run"] is run and mod.helper is helper

    theirs = contract.foreign(helper)
    mod.helper = theirs
    said = contract.logged("hs_capture.patching.base")
    assert "toy_undone.helper is already wrapped by a FunctionWrapper of tests.patching_contract" in said(
        toy.instrument)
    assert toy.outcomes == [WRAPPED, REFUSED] and mod.helper is theirs and toy.refused == ["toy_undone.helper"]
    ours = vars(mod.Base)["run"]
    mod.Base.run = contract.foreign(ours)  # stacked on ours after the fact: taking ours out would drop theirs
    assert "Base.run was replaced after it was wrapped" in said(toy.uninstrument)
    assert vars(mod.Base)["run"].__wrapped__ is ours and mod.Child().run(4) == ("run", 4)
    mod.Base.run, mod.helper = run, helper


def test_a_trainer_patch_stands_down_on_a_foreign_wrapper_and_another_instance_is_foreign(planted):
    import importlib

    name = planted("toy_trainer")

    class Patch(TrainerPatch):
        NAME = "toy"
        POINTS = (Point(name, "Child.run", "_record"), Point(name, "helper", "_record"), Point(name, "absent", "x"))

        def _record(self, wrapped, instance, args, kwargs):
            return ("patched", wrapped(*args, **kwargs))

    first, second = Patch(), Patch()
    assert first.instrument("data.jsonl") and first.dataset == "data.jsonl"
    mod = importlib.import_module(name)  # a point the module lacks is left to check() to name
    assert mod.helper(1) == ("patched", ("helper", 1))
    with pytest.raises(Unsupported, match=r"^Base.run is already wrapped by another Patch: the toy dump patch"):
        second.instrument(None)
    assert not second.is_instrumented and mod.helper(2) == ("patched", ("helper", 2))
    first.uninstrument()
    assert first.dataset is None and mod.helper(3) == ("helper", 3)
