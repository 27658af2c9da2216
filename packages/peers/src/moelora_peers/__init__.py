"""SGLang's and vLLM's released MoE-LoRA kernels as moelora backends."""
