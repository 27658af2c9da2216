"""Stands in for ``sglang.srt.utils.hf_transformers_utils`` (transformers config loading).

Provides: ``AutoConfig``, a placeholder class: ``sglang.srt.lora.utils`` imports it for the type
annotations of model-shape helpers the MoE-LoRA kernels never call (so transformers 5.19, which
SGLang 0.5.23 pins, is not needed).
"""


class AutoConfig:
    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("moelora_peers: model configs are not part of the layer suite")
