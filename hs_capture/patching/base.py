"""The instrumentor: one object per patch, holding everything it wrapped (after OpenTelemetry's
BaseInstrumentor).

`instrument()` runs the subclass's `_instrument()` once (a repeat call warns and changes nothing);
`_instrument()` wraps with `wrap()` (a wrapt FunctionWrapper, on the class that defines the
attribute) or `replace()` (a wrapt proxy of the subclass's making), now or from post-import hooks
it registers with `when_imported()`. An attribute already wrapped by anyone else is refused,
never stacked on, and said so (`on_refused`). `uninstrument()` disables the hooks, runs
`_uninstrument()` and puts back, one for one, the very objects that were there.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import wrapt

WRAPPED, SHARED, REFUSED = "wrapped", "shared", "refused"

# wrapt 2 moved the proxy base (FunctionWrapper no longer subclasses wrapt.ObjectProxy)
_PROXY = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)


def is_wrapped(obj: Any) -> bool:
    """Whether obj is a wrapt proxy (anyone's)."""
    return isinstance(obj, _PROXY)


def is_ours(obj: Any) -> bool:
    """Whether obj is a proxy an Instrumentor put there."""
    return is_wrapped(obj) and bool(getattr(obj, "_self_hscap_wrapper", False))


def owner_of(obj: Any) -> Optional["Instrumentor"]:
    """The Instrumentor that put the proxy obj in place, None for anything else."""
    return getattr(obj, "_self_hscap_owner", None) if is_ours(obj) else None


def defining_class(cls: type, attr: str) -> type:
    """The class in cls's MRO whose own namespace holds attr: a wrapper put there reaches every
    subclass that inherits it, once."""
    for klass in cls.__mro__:
        if attr in vars(klass):
            return klass
    raise AttributeError(f"{cls.__name__} has no {attr}")


def where(owner: Any, attr: str) -> str:
    """owner.attr as a message names it."""
    return f"{getattr(owner, '__qualname__', None) or getattr(owner, '__name__', repr(owner))}.{attr}"


class Slot(NamedTuple):
    """One attribute an instrumentor replaced: what was there and the proxy it put in its place."""
    owner: Any  # the class that defines the attribute, or a module
    attr: str
    original: Any
    proxy: Any


class _Hook:
    """A post-import hook that does nothing once disabled (wrapt cannot unregister one)."""

    def __init__(self, fn: Callable[[Any], None]) -> None:
        self.fn = fn
        self.active = True

    def __call__(self, module: Any) -> None:
        if self.active:
            self.fn(module)


class Instrumentor:
    """Subclass it: `_instrument(**kwargs)` patches (return False when there was nothing to
    patch: then it stays uninstrumented), `_uninstrument()` drops the subclass's own state;
    both run under the instrumentor's lock."""

    log: logging.Logger = logging.getLogger(__name__)

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._instrumented = False
        self._slots: List[Slot] = []
        self._hooks: List[_Hook] = []
        self.refused: List[str] = []  # what was found wrapped by someone else, left as it was

    @property
    def is_instrumented(self) -> bool:
        return self._instrumented

    @property
    def slots(self) -> Tuple[Slot, ...]:
        """What is wrapped now, in the order it was wrapped."""
        return tuple(self._slots)

    def instrument(self, **kwargs: Any) -> bool:
        """Patch (kwargs go to `_instrument`). False, with a warning, when already instrumented."""
        with self._lock:
            if self._instrumented:
                self.log.warning("%s.instrument() called twice: already instrumented", type(self).__name__)
                return False
            return self._begin(kwargs)

    def extend(self, **kwargs: Any) -> bool:
        """Run `_instrument(**kwargs)` once more on an instrumented object, for what a hook
        registered elsewhere hands over (the server's bootstrap: a target module imported later);
        `_instrument` skips what it has done. Not instrumented yet: instrument(**kwargs)."""
        with self._lock:
            if not self._instrumented:
                return self._begin(kwargs)
            self._instrument(**kwargs)
            return True

    def uninstrument(self) -> bool:
        """Undo every patch. False, with a warning, when nothing is instrumented."""
        with self._lock:
            if not self._instrumented:
                self.log.warning("%s.uninstrument() called but nothing is instrumented", type(self).__name__)
                return False
            self._undo()
            return True

    # ------------------------------------------------------------- for subclasses
    def _instrument(self, **kwargs: Any) -> Optional[bool]:
        raise NotImplementedError

    def _uninstrument(self) -> None:
        pass

    def on_refused(self, owner: Any, attr: str, current: Any, note: str) -> None:
        """owner.attr is someone else's wrapper: left as it is. Says so in a warning; a subclass
        for which a missing patch means wrong results raises instead."""
        self.log.warning("%s is already wrapped by %s: left as it is%s", where(owner, attr), self.whose(current),
                         f" ({note})" if note else "")

    def whose(self, proxy: Any) -> str:
        """Who put the wrapper proxy in place, as a refusal names it."""
        other = owner_of(proxy)
        if other is not None:
            return f"another {type(other).__name__}"
        wrapper = getattr(proxy, "_self_wrapper", None)  # a FunctionWrapper's wrapper names its maker
        return f"a {type(proxy).__name__} of {getattr(wrapper, '__module__', None) or type(proxy).__module__}"

    def when_imported(self, module: str, fn: Callable[[Any], None]) -> None:
        """Run fn(module) once the module is imported (now, if it is), while instrumented."""
        hook = _Hook(fn)
        self._hooks.append(hook)
        wrapt.register_post_import_hook(hook, module)

    def wrap(self, owner: Any, attr: str, wrapper: Callable, note: str = "") -> str:
        """Wrap owner.attr (a class: on the class that defines it; a module: its own binding) in
        a wrapt FunctionWrapper calling wrapper(wrapped, instance, args, kwargs) while this
        instrumentor is instrumented, and passing straight through once it is not. Returns
        WRAPPED, SHARED (already ours) or REFUSED (someone else's wrapper: see on_refused)."""

        def active(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
            if self._instrumented:
                return wrapper(wrapped, instance, args, kwargs)
            return wrapped(*args, **kwargs)  # left in place under a later wrapper: inert

        return self.replace(owner, attr, lambda original: wrapt.FunctionWrapper(original, active), note)

    def replace(self, owner: Any, attr: str, make: Callable[[Any], Any], note: str = "") -> str:
        """Put make(original), a wrapt proxy of it, in owner.attr's place (wrap's rules). The
        proxy's own methods must pass through for anything that is not theirs: unlike wrap's
        wrapper, nothing turns them off if the proxy cannot be taken back."""
        with self._lock:
            if isinstance(owner, type):
                owner = defining_class(owner, attr)
            if attr not in vars(owner):
                raise AttributeError(f"{where(owner, attr)} does not exist: nothing to wrap")
            current = vars(owner)[attr]
            if owner_of(current) is self:
                # our proxy: here already, or bound here by an import of the module we wrapped
                # (`from m import f` after m.f was wrapped), or left by an uninstrument it
                # outlived: recorded once, so uninstrument puts the function itself back
                if not any(s.owner is owner and s.attr == attr for s in self._slots):
                    self._slots.append(Slot(owner, attr, current.__wrapped__, current))
                return SHARED
            if is_wrapped(current):  # someone else's: never a second layer
                self.refused.append(where(owner, attr))
                self.on_refused(owner, attr, current, note)
                return REFUSED
            proxy = make(current)
            proxy._self_hscap_wrapper = True
            proxy._self_hscap_owner = self
            setattr(owner, attr, proxy)
            self._slots.append(Slot(owner, attr, current, proxy))
            return WRAPPED

    # ------------------------------------------------------------- internals
    def _begin(self, kwargs: Dict[str, Any]) -> bool:
        self._instrumented = True  # wrappers and hooks run from here on
        self.refused = []
        try:
            done = self._instrument(**kwargs)
        except BaseException:
            self._undo()  # half a patch is worse than none
            raise
        if done is False:
            self._undo()
            return False
        return True

    def _undo(self) -> None:
        for hook in self._hooks:
            hook.active = False
        self._hooks.clear()
        try:
            self._uninstrument()
        finally:
            self._unwrap_all()
            self._instrumented = False

    def _unwrap_all(self) -> None:
        for slot in reversed(self._slots):
            current = vars(slot.owner).get(slot.attr)
            if current is slot.proxy:
                setattr(slot.owner, slot.attr, slot.original)
            else:  # replaced since (a wrapper stacked on ours): taking ours out would drop theirs
                self.log.warning("%s was replaced after it was wrapped: left as it is (our wrapper in it, if "
                                 "any, passes calls straight through)", where(slot.owner, slot.attr))
        self._slots.clear()
