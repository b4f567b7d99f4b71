"""Test stand-in for sgl_kernel, for releases that import part of it unconditionally:
sglang 0.5.10 imports sgl_kernel.kvcacheio from its radix cache even on a CPU, and the
only sgl_kernel builds on the registry are CUDA ones that do not load here. Only the
submodules such a release cannot start without exist (calling their functions raises);
everything else stays an ImportError, so SGLang's own "is sgl_kernel there?" fallbacks
still choose the CPU paths. Only the venv of such a release sees this (a .pth written by
bin/setup_sglang_venv.sh); the suite's own venv never does."""
