# hs_capture bootstrap. No logic here: it lives in hs_capture.server.bootstrap (ddtrace's pattern).
# Loaded by `PYTHONPATH=<this dir> python -m sglang.launch_server ...` in every SGLang
# process; then it chain-loads the sitecustomize this file shadows on sys.path.
import os
import sys

loaded = False


def _debug(msg):
    if os.environ.get("HSCAP_DEBUG"):
        sys.stderr.write("[HS_DUMP] sitecustomize: %s\n" % msg)


try:
    try:
        import hs_capture  # noqa: F401  (installed copy)
    except ImportError:  # running from a checkout: the package sits three levels up
        sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__)))))
    from hs_capture.server import bootstrap

    _debug("hooks registered" if bootstrap.run() else "inert (HSCAP_DIR not set)")
    loaded = True
except Exception as e:  # never break the host process
    sys.stderr.write("[HS_DUMP] ERROR: bootstrap failed, capture is OFF: %s: %s\n" % (type(e).__name__, e))

# Chain to the sitecustomize we shadow: only the first one on sys.path is imported.
_here = os.path.dirname(os.path.abspath(__file__))
_index = None
for _i, _p in enumerate(list(sys.path)):
    if os.path.abspath(_p or ".") == _here:
        _index = _i if _index is None else _index
        sys.path.remove(_p)
_self = sys.modules.pop("sitecustomize", None)
try:
    import sitecustomize  # noqa: F401  the user's, if any
    _debug("chained to %s" % getattr(sys.modules.get("sitecustomize"), "__file__", "?"))
except ImportError:
    pass
except Exception as e:
    sys.stderr.write("[HS_DUMP] the shadowed sitecustomize failed: %s: %s\n" % (type(e).__name__, e))
finally:
    if sys.modules.get("sitecustomize") is None and _self is not None:
        sys.modules["sitecustomize"] = _self
    sys.modules.setdefault("hs_capture_sitecustomize", _self)
    if _index is not None:
        sys.path.insert(_index, _here)
