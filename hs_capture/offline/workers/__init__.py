"""What merge's and verify's worker processes share:

    procs.py  the worker processes (a fork server that imports their module once), job counts,
              peak memory
    heap.py   keep large decode buffers in the heap between steps
"""
