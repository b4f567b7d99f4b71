# sglang/srt/layers/rotary_embedding/base.py imports `rotary_embedding` from here on
# platforms that are neither CUDA nor SGLang's CPU engine; the native path never calls it.
def rotary_embedding(*args, **kwargs):
    raise NotImplementedError("test shim: vllm._custom_ops.rotary_embedding was called")
