"""Stands in for ``vllm.lora.utils`` (adapter discovery and module replacement: imports vLLM's model
executor, transformers utilities and the Hub client).

Provides: ``get_captured_lora_counts(max_loras, specialize)``, the one name the punica wrapper
imports: the ``num_active_loras`` values CUDA graphs are captured for (vLLM's definition:
``[max_loras + 1]`` without specialisation; else the powers of two up to ``max_loras`` and
``max_loras + 1``).
"""


def get_captured_lora_counts(max_loras: int, specialize: bool) -> list[int]:
    if not specialize:
        return [max_loras + 1]
    return [n for n in range(1, max_loras + 2) if (n & (n - 1)) == 0 or n == max_loras + 1]
