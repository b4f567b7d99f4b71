"""The contract every instrumentor keeps, the trainers' patches and the server's hooks alike:
a second instrument() changes nothing, a wrapper someone else put on one of its points is
refused (never stacked on) and said so, and uninstrument() puts back the very objects that were
there. Plain functions, so a trainer's own venv runs them too:

    python tests/patching_contract.py TRAINER      # prints {"ok": true} or {"error": ...}
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import sys
import tempfile
import traceback
from typing import Any, Callable, List, Tuple

import wrapt

from hs_capture.patching import defining_class, is_ours, is_wrapped, where

Place = Tuple[Any, str]  # (the class that defines the attribute, or a module; the attribute)


def current(places: List[Place]) -> List[Any]:
    return [vars(owner)[attr] for owner, attr in places]


def foreign(obj: Any) -> Any:
    """A wrapper none of ours: what another instrumentation library would have put there."""
    if callable(obj):
        return wrapt.FunctionWrapper(obj, lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    return wrapt.ObjectProxy(obj)


def same(a: List[Any], b: List[Any]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def instrument_twice_changes_nothing(make: Callable[[], Any], places: List[Place],
                                     instrument: Callable[[Any], Any]) -> None:
    inst = make()
    originals = current(places)
    assert instrument(inst), "the first instrument() patched nothing"
    try:
        wrapped = current(places)
        for (owner, attr), proxy, original in zip(places, wrapped, originals):
            # ours, one layer around the original
            assert is_ours(proxy) and proxy.__wrapped__ is original, f"{where(owner, attr)} is not wrapped once"
        assert not instrument(inst), "a second instrument() says it patched"
        assert same(current(places), wrapped), "a second instrument() changed what is wrapped"
    finally:
        inst.uninstrument()
    assert same(current(places), originals), "uninstrument() after a repeat call left a wrapper"


def uninstrument_restores_the_originals(make: Callable[[], Any], places: List[Place],
                                        instrument: Callable[[Any], Any]) -> None:
    inst = make()
    originals = current(places)
    for _ in range(2):  # and instrument works again after uninstrument
        assert instrument(inst)
        assert not any(x is y for x, y in zip(current(places), originals)), "instrument() left a point as it was"
        inst.uninstrument()
        assert not inst.is_instrumented
        for (owner, attr), now, original in zip(places, current(places), originals):
            assert now is original, f"uninstrument() left {where(owner, attr)} as {now!r}, not {original!r}"
    inst.uninstrument()  # nothing instrumented: changes nothing
    assert same(current(places), originals), "a second uninstrument() changed a point"


def refuses_to_stack(make: Callable[[], Any], places: List[Place], instrument: Callable[[Any], Any],
                     said: Callable[[Callable[[], Any]], str], stops: bool) -> None:
    """With someone else's wrapper on each point in turn: instrument leaves it as it is and says
    so, naming it where it is defined (`said` runs instrument and returns what was said). With
    `stops`, the patch then stands down (every other point as it was); else it patches the
    others."""
    originals = current(places)
    for i, (owner, attr) in enumerate(places):
        theirs = foreign(originals[i])
        setattr(owner, attr, theirs)
        inst = make()
        try:
            message = said(lambda: instrument(inst))
            assert "already wrapped" in message and where(owner, attr) in message, \
                f"the refusal of {where(owner, attr)} does not say so: {message!r}"
            assert vars(owner)[attr] is theirs, f"{where(owner, attr)}: the foreign wrapper was replaced"
            assert not is_wrapped(theirs.__wrapped__), f"{where(owner, attr)}: stacked under the foreign wrapper"
            others = [(p, o) for j, (p, o) in enumerate(zip(places, originals)) if j != i]
            for (o, a), original in others:
                now = vars(o)[a]
                if stops:
                    assert now is original, f"{where(o, a)} stays wrapped after the patch stood down"
                else:
                    assert is_ours(now) and now.__wrapped__ is original, f"{where(o, a)} was not patched"
            assert inst.is_instrumented != stops
        finally:
            if inst.is_instrumented:
                inst.uninstrument()
            assert vars(owner)[attr] is theirs, f"uninstrument() took the foreign wrapper off {where(owner, attr)}"
            setattr(owner, attr, originals[i])
        assert same(current(places), originals)


def raised(kind: type) -> Callable[[Callable[[], Any]], str]:
    def said(call: Callable[[], Any]) -> str:
        try:
            call()
        except kind as e:
            return str(e)
        raise AssertionError(f"instrument() raised no {kind.__name__}")
    return said


def logged(logger: str) -> Callable[[Callable[[], Any]], str]:
    class Lines(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.lines: List[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    def said(call: Callable[[], Any]) -> str:
        lines, log = Lines(), logging.getLogger(logger)
        log.addHandler(lines)
        try:
            call()
        finally:
            log.removeHandler(lines)
        return "\n".join(lines.lines)
    return said


# ------------------------------------------------------------------ the trainers
def trainer_places(patch_cls: type, plant: str) -> List[Place]:
    """Where a trainer patch's points are, each module imported; a module that is no package of
    this venv (ModelOpt's eagle_utils lives in a Model-Optimizer checkout) is planted in `plant`
    as a stand-in holding the attribute, to be imported as the trainer would import it."""
    places: List[Place] = []
    for point in patch_cls.POINTS:
        if importlib.util.find_spec(point.module.split(".")[0]) is None:
            _plant(plant, point.module, point.path)
        module = importlib.import_module(point.module)
        *classes, attr = point.path.split(".")
        owner: Any = module
        for name in classes:
            owner = getattr(owner, name)
        if isinstance(owner, type):
            owner = defining_class(owner, attr)
        if (owner, attr) not in [(o, a) for o, a in places]:
            places.append((owner, attr))
    return places


def _plant(root: str, module: str, path: str) -> None:
    parts = module.split(".")
    folder = os.path.join(root, *parts[:-1])
    os.makedirs(folder, exist_ok=True)
    for i in range(1, len(parts)):
        open(os.path.join(root, *parts[:i], "__init__.py"), "a").close()
    *classes, attr = path.split(".")
    body = f"def {attr}(*args, **kwargs):\n    return None\n"
    for name in reversed(classes):
        body = f"class {name}:\n" + "".join("    " + line + "\n" for line in body.splitlines())
    with open(os.path.join(folder, parts[-1] + ".py"), "w") as f:
        f.write(body)
    if root not in sys.path:
        sys.path.insert(0, root)


def trainer_contract(name: str) -> None:
    from hs_capture.offline.train.trainers import load
    from hs_capture.offline.train.trainers.patching import Unsupported

    patch = load(name)
    problem = patch.check()
    assert problem is None, problem
    with tempfile.TemporaryDirectory() as plant:
        places = trainer_places(patch.PATCH, plant)
        instrument = lambda inst: inst.instrument(None)  # noqa: E731
        instrument_twice_changes_nothing(patch.PATCH, places, instrument)
        uninstrument_restores_the_originals(patch.PATCH, places, instrument)
        refuses_to_stack(patch.PATCH, places, instrument, raised(Unsupported), stops=True)


if __name__ == "__main__":
    try:
        trainer_contract(sys.argv[1])
        print(json.dumps({"ok": True}))
    except Exception:
        print(json.dumps({"error": traceback.format_exc()}))
