"""hs_capture: make an unmodified SGLang server dump EAGLE-3 hidden states.

Server side (loaded through sitecustomize, never imports the offline tools):
    bootstrap -> instrumentor (wrapt patching) -> capture (what to take from a forward)
    -> writer (off the critical path) -> format/layout (the on-disk contract)
Offline side (never imports sglang): reader, coverage, planning (index lines only), send,
assemble -> formats -> merge (plans, hands out work) / merge_worker (decodes, writes),
procs (worker processes), verify/, dataset, cli/ (one module per command).
"""

__version__ = "0.1.0"
