"""The host versions hs_capture instruments (mirrored by the `instruments` extra in setup.cfg)."""

INSTRUMENTS = ("sglang >= 0.5.10",)
