"""Everything that runs inside the SGLang server (loaded through sitecustomize). Imports the
dump contract, never the offline tools.

    bootstrap -> instrumentor (wrapt patching of targets) -> capture (what a forward hands
    over: step) -> staging (device to shared host buffers) -> writer (back-pressure: backlog;
    what the hook cost: forward_cost) -> writer_process (the rank's writer, a process of its
    own, reached through channel) -> store (threads that write: step_files; the rank's record:
    run_record). sglang_compat and modes read SGLang; config the HSCAP_* settings; doctor
    checks an environment before serving; log the [HS_DUMP] lines.
"""
