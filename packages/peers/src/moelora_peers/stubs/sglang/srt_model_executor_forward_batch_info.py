"""Stands in for ``sglang.srt.model_executor.forward_batch_info`` (the server's batch object).

Provides: ``ForwardBatch``, a placeholder class: ``sglang.srt.lora.utils`` imports it for the type
annotations of helpers the MoE-LoRA kernels never call (constructing one raises).
"""


class ForwardBatch:
    def __init__(self, *args, **kwargs) -> None:
        raise NotImplementedError("moelora_peers: the server's ForwardBatch is not part of the layer suite")
