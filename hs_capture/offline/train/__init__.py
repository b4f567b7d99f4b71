"""Training readers and trainer patches:

    dataset.py       HsCaptureDataset: `hscap merge --format hscap` output, random access
    dump_dataset.py  DumpDataset: training straight from a dump (and its live mode)
    step_sampler.py  the order a DumpDataset is read in: shuffled, each step decoded about once
    trainers/        `hscap train`: one runtime patch per trainer, reading from a dump

Users reach the datasets as `hs_capture.DumpDataset` and `hs_capture.HsCaptureDataset`.
"""
