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
