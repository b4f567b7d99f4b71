"""SGLang general plugin (entry-point group "sglang.srt.plugins"), found through the
.dist-info folder beside this file. Test environment only.

With --attention-backend torch_native, DeepSeek MLA prefill falls back to the MHA
path, which reads K/V from the latent MLA cache and fails on shapes. Registering a
torch_native handler that picks the absorbed-MLA method (the one decode uses) fixes
it, through SGLang's public AttentionBackendRegistry.
"""


def register():
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )

    def handle_attention_torch_native(attn, forward_batch):
        return _dispatch_mla_subtype(attn, forward_batch)

    AttentionBackendRegistry.register("torch_native", handle_attention_torch_native)
    _gloo_model_parallel_groups()
    _dp_attention_padding_on_cpu()


def _dp_attention_padding_on_cpu():
    """--enable-dp-attention pads every DP group's batch to a common size. The padding code
    tells CPU from GPU by sglang's is_cpu(), which is true only with SGLANG_USE_CPU_ENGINE
    (which these tests cannot set: see ../README.md); without it, it pins memory and asks
    the attention backend for its CUDA-graph fill value. On a machine without CUDA, tell it
    the truth."""
    import torch

    if torch.cuda.is_available():
        return
    import importlib

    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    # Feature-detected, module by module: other releases lay these out differently.
    for name in ("sglang.srt.model_executor.forward_batch_info",  # no pinned memory
                 "sglang.srt.layers.dp_attention",  # rows copied with torch, not triton
                 "sglang.srt.distributed.parallel_state"):  # all-gather via torch.distributed
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "_is_cpu"):
            module._is_cpu = True
        if hasattr(module, "memcpy_cpu") and hasattr(module, "memcpy_func"):
            module.memcpy_func = module.memcpy_cpu
    # ...which asks the backend for the sequence length of padding rows; torch_native never
    # says (it has no graphs). 1, as SGLang's CPU backend answers.
    if not hasattr(TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value"):
        TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = lambda self: 1


def _gloo_model_parallel_groups():
    """--tp N on a CPU: SGLang's base platform (no CUDA, no SGLANG_USE_CPU_ENGINE) makes every
    model-parallel group build a PyNccl communicator, which needs CUDA. A group built with
    use_pynccl=False all-reduces CPU tensors through torch.distributed (gloo). Only the
    caller's *default* changes: an explicit choice is passed through."""
    import torch

    if torch.cuda.is_available():
        return
    from sglang.srt.distributed import parallel_state as ps

    real = ps.init_model_parallel_group
    if getattr(real, "_hscap_gloo", False):
        return

    def init_model_parallel_group(*args, **kwargs):
        if kwargs.get("use_pynccl") is None and len(args) < 4:  # (group_ranks, local_rank, backend, ...)
            kwargs["use_pynccl"] = False
        return real(*args, **kwargs)

    init_model_parallel_group._hscap_gloo = True
    ps.init_model_parallel_group = init_model_parallel_group
