"""`hscap merge` and its output: dumps -> training-ready samples in a training format.

    merge.py         plans the samples and hands out the work (no torch)
    merge_worker.py  what runs in the worker processes: cut samples out and write them
    merge_result.py  what a merge and each worker report
    output_dir.py    where merge may write, and the manifest of what it wrote

The formats it writes are formats/ (reached through their registry only).
"""
