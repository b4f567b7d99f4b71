"""The offline tools: read dumps through the dump contract, never import sglang or the server
side.

    inputs (the dataset), reader (runs, index lines, step files), coverage (the one
    completeness rule), planning (index lines only) -> assemble (stitch samples) -> formats/
    (the training-format interface, one module per format, their registry) -> merge (plans,
    hands out work: procs) / merge_worker (decodes, writes; output_dir says where it may);
    verify/; send; dataset.
"""
