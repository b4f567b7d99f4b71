"""Test environment only: chained by hs_capture's sitecustomize (or first on the path) in every
process of a test server, the writer process included, so that a fault planted here reaches
whichever process writes. Production code carries no test hook.

HSCAP_TEST_SLOW_DISK_MS=N: every step the writer writes takes N ms longer (a slow disk).
HSCAP_TEST_DISK_GATE=PATH: while PATH exists, the writer's next write waits (a stalled disk
that the test lets go of: steps are certainly queued, however fast or slow the host is).
HSCAP_TEST_SLOW_MERGE_MS=N: every output file `hscap merge` writes takes N ms longer, in the
merge process and its workers alike (a Ctrl-C then lands mid-merge on any machine).
"""
import os

if float(os.environ.get("HSCAP_TEST_SLOW_DISK_MS", "0") or 0) or os.environ.get("HSCAP_TEST_DISK_GATE"):
    import wrapt

    @wrapt.when_imported("hs_capture.server.store")
    def _slow_disk(module):
        import time

        ms = float(os.environ.get("HSCAP_TEST_SLOW_DISK_MS", "0") or 0)
        gate = os.environ.get("HSCAP_TEST_DISK_GATE")
        real = module.ShardStore.write

        def slow(self, *args, **kwargs):
            while gate and os.path.exists(gate):
                time.sleep(0.05)
            time.sleep(ms / 1000.0)
            return real(self, *args, **kwargs)

        module.ShardStore.write = slow

if float(os.environ.get("HSCAP_TEST_SLOW_MERGE_MS", "0") or 0):
    import wrapt

    @wrapt.when_imported("hs_capture.offline.merge.merge_worker")
    def _slow_merge(module):
        import time

        ms = float(os.environ["HSCAP_TEST_SLOW_MERGE_MS"])
        real = module.write

        def slow(outputs, *args, **kwargs):
            time.sleep(ms / 1000.0 * len(outputs))
            return real(outputs, *args, **kwargs)

        module.write = slow
