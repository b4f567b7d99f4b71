"""Test stand-in for Moonshot's remote-code KimiK25Processor (loaded with
--trust-remote-code): SGLang's Kimi-K2.5 processor reads `media_processor.media_proc_cfg`
from it. Text-only requests never use it."""
from types import SimpleNamespace

from transformers import AutoTokenizer
from transformers.models.kimi_k25.image_processing_kimi_k25 import Kimi_K25ImageProcessor
from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor


class TinyKimiK25Processor(Kimi_K25Processor):
    def __init__(self, image_processor=None, tokenizer=None, **kwargs):
        super().__init__(image_processor=image_processor, tokenizer=tokenizer, **kwargs)
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.media_processor = SimpleNamespace(media_proc_cfg={
            "patch_size": 14, "merge_kernel_size": [2, 2], "in_patch_limit": 256,
            "patch_limit_on_one_side": 64, "fixed_output_tokens": None,
            "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]})

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        return cls(image_processor=Kimi_K25ImageProcessor(), tokenizer=AutoTokenizer.from_pretrained(path))
