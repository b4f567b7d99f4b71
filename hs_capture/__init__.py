"""hs_capture: make an unmodified SGLang server dump EAGLE-3 hidden states.

    dump/     the contract both sides share (paths, the .hst file, the typed records)
    server/   everything that runs inside SGLang (never imports offline/)
    offline/  send, merge, verify, the datasets (never imports server/ or sglang)
    cli/      the `hscap` commands, on top of both
    patching/ the instrumentor both sides patch with (wrapt only: neither side, no torch)
    sitecustomize/  the hook's entry point on PYTHONPATH
"""

from hs_capture.version import __version__

__all__ = ["DumpDataset", "HsCaptureDataset", "__version__"]


def __getattr__(name: str):
    """The datasets import torch: loaded on first use, so the server hook and the CLI start
    without them."""
    if name == "DumpDataset":
        from hs_capture.offline.train.dump_dataset import DumpDataset

        return DumpDataset
    if name == "HsCaptureDataset":
        from hs_capture.offline.train.dataset import HsCaptureDataset

        return HsCaptureDataset
    raise AttributeError(f"module 'hs_capture' has no attribute {name!r}")
