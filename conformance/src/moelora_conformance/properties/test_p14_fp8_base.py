"""P14: on an fp8 block-scaled base (w8a8, DESIGN.md §1 "Quantized base") the delta is applied on every
MoE path the backend declares, and base rows equal the quantized base alone.

The drawn case (up to 32 tokens and 8 requests) has its experts quantized to fp8 with block scales
(block rows drawn among 8 and 16, K groups of 16, partial edge blocks wherever H or I is not a
multiple), its spec says
``base_quant="fp8_block"``; the adapters stay in the case dtype. Each example runs the same batch on
every MoE path the backend declares — the harness's w8a8 torch base with the backend's deltas (fp32
and model-dtype intermediates) and the backend's own ``moe_forward`` where it declares ``fused_moe``
— each checked by the standard checks under the policy's fp8 rows: outputs equal the oracle's w8a8
with the LoRA on the unquantized activations; every LoRA row differs from the same row with the adapter
disabled by the oracle's delta (a skipped delta, or one computed from quantized activations, fails
here); base rows are bit-identical to the LoRA-disabled run. Runs only for a backend declaring
``fp8_block`` in ``Capabilities.base_quants`` (others: not implemented).
"""

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.properties.registry import conformance
from moelora_conformance.properties.support import Subject, draw_capacity, draw_case, trace
from moelora_conformance.strategies.cases import quantized_case


@conformance("P14")
@given(data=st.data())
def test_delta_applied_on_every_fp8_path_and_base_rows_equal_the_quantized_base(moelora_suite, mode, dtype, data):
    suite = moelora_suite
    # SwiGLU blocks without biases: the format's experts (GPT-OSS's releases are MXFP4, refused). Batches up
    # to 32 tokens and 8 requests: what is new here is the base, not the batch (P01-P05 draw the large ones);
    # each example runs every path, which keeps the property within the main job's budget
    caps = replace(suite.caps, max_tokens=min(suite.caps.max_tokens, 32), max_requests=min(suite.caps.max_requests, 8))
    case = draw_case(data, suite, mode, dtype, kinds=("extend", "decode", "mixed"), blocks=("swiglu",), caps=caps)
    block = (data.draw(st.sampled_from((8, 16)), label="fp8 block rows"), 16)
    trace(f"fp8 block {list(block)}")
    m = quantized_case(case.materialize(suite.device), block)
    capacity = draw_capacity(data, mode, [case.batch])
    for path in suite.moe_paths:
        subject = Subject(suite, case, mode, path, capacity, materialized=m)
        subject.run_and_check(subject.inputs(), f"fp8 base, {path} path")
