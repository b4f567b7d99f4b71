# Not vLLM: an import-only stand-in so the real SGLang runs on a CPU-only test machine (see ../README.md).
