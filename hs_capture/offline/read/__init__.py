"""Reading a dump, and the one completeness rule send, merge, verify and the datasets judge by
(index lines only until a sample is assembled; no torch before assemble.py):

    inputs.py       the input file or dataset directory: ids, token ids, loss masks
    reader.py       runs, their metadata, index lines and step tensors
    coverage.py     the one completeness rule: which pieces make a request whole
    attribution.py  which captured requests are a user's (warmups, health checks, SGLang's rids)
    planning.py     the pieces that make every request whole, from index lines only
    assemble.py     stitch the planned samples out of the decoded steps
    follow.py       the same rule on a dump still being written (live reading)
"""
