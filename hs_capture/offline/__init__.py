"""The offline tools: read dumps through the dump contract, never import sglang or the server
side. One folder per thing a user does with a dump, on the readers they share:

    send.py    `hscap send`: feed the inputs to a running server so it dumps them
    read/      reading a dump and the one completeness rule: the inputs, runs and index lines,
               coverage, planning (index lines only), assemble (stitch samples), follow (live)
    merge/     `hscap merge` and its output: plan and hand out work, the workers that write,
               the output directory, the result it reports
    formats/   the training formats: the interface, one module per format, their registry
    verify/    `hscap verify`: dumps and merged output checked complete, intact and sane
    train/     training readers and trainer patches: HsCaptureDataset (merged output),
               DumpDataset (straight from a dump) and its sampler, trainers/ (`hscap train`)
    workers/   the worker processes merge and verify share (procs) and their heap (heap)

send, merge, verify and train sit on read, formats and workers, never the other way round
(.importlinter). The datasets are `hs_capture.DumpDataset` and `hs_capture.HsCaptureDataset`.
"""
