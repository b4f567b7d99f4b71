"""The dump contract: what the server writes and the offline tools read, importing neither.

    paths      where things live in a dump dir: runs, ranks (RankId), index, step files, parts
    schema     the typed, versioned records: run metadata, index lines, sequence entries
    hst        the .hst tensor file (a small self-describing header, then coded bytes)
    codec      the payload codecs (raw, zstd, bytegroup) and dtype names
    bytegroup  the float-aware byte-plane codec
    files      atomic writes (temp name, fsync, rename)
    layer_ids  the drafter layer ids a serving engine maps onto captured layers
"""
