"""Host-memory KV transfer kernels (HiCache): never called with the radix cache off."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def stub(*args, **kwargs):
        raise NotImplementedError(f"test shim: sgl_kernel.kvcacheio.{name} was called")

    return stub
