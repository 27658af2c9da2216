"""The oracle checked against code no one here wrote: HF transformers + PEFT (DESIGN.md §2; ``docs/checkpoints.md``).

Needs the ``fixtures`` extra. CLI: ``moelora-conformance hf-check [--fixtures DIR]``.

- :mod:`.hf_model`: load and run the transformers / peft side.
- :mod:`.extract`: moelora tensors from the in-memory transformers / peft modules.
- :mod:`.compare`: one layer, oracle vs HF, by the tolerance policy (:class:`CheckRow`).
- :mod:`.per_module`: the per-module reference for legacy per-expert adapters.
- :mod:`.model_logprobs`: whole-model prompt logprobs, the engine vs HF + PEFT (DeepSeek-V3).
- :mod:`.hf_w8a8`: transformers' model of an fp8 checkpoint made w8a8 (E02's reference on an fp8 base).
- :mod:`.fp8_crossings`: what e4m3 crossings and the known faults move that model's logprobs by (the
  fp8 logprob rows' measurement; ``python -m moelora_conformance.hf_check.fp8_crossings``).
- :mod:`.run`: every model and adapter of a fixtures directory.
- :mod:`.table`: the rich summary table.
"""

from moelora_conformance.hf_check.compare import CheckRow
from moelora_conformance.hf_check.run import check_adapter, check_layout_adapter, check_model_base, run_hf_check
from moelora_conformance.hf_check.table import render, summarize

__all__ = ["CheckRow", "check_adapter", "check_layout_adapter", "check_model_base", "render", "run_hf_check",
           "summarize"]
