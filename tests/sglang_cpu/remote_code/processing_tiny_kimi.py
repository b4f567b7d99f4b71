"""Test stand-in for Moonshot's remote-code KimiK25Processor (loaded with
--trust-remote-code): SGLang's Kimi-K2.5 processor reads its tokenizer and
`media_processor` (`media_proc_cfg`). Text-only requests never use the media side. Plain
Python, so it loads with any transformers release (5.3.0 has no Kimi-K2.5 classes)."""
from types import SimpleNamespace

from transformers import AutoTokenizer


class TinyKimiK25Processor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.image_processor = None
        self.media_processor = SimpleNamespace(media_proc_cfg={
            "patch_size": 14, "merge_kernel_size": [2, 2], "in_patch_limit": 256,
            "patch_limit_on_one_side": 64, "fixed_output_tokens": None,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]})

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        return cls(AutoTokenizer.from_pretrained(path))

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoProcessor"):
        """AutoProcessor calls this on remote classes; nothing to register."""

    def __call__(self, text=None, **kwargs):
        return self.tokenizer(text, **kwargs)
