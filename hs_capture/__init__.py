"""hs_capture: make an unmodified SGLang server dump EAGLE-3 hidden states.

    dump/     the contract both sides share (paths, the .hst file, the typed records)
    server/   everything that runs inside SGLang (never imports offline/)
    offline/  send, merge, verify, the datasets (never imports server/ or sglang)
    cli/      the `hscap` commands, on top of both
    sitecustomize/  the hook's entry point on PYTHONPATH
"""

__version__ = "0.2.0"
