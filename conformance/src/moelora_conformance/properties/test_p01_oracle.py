"""P01: every output row equals the oracle.

One drawn case per example — ragged EXTEND (fresh and chunked), DECODE (1–4 tokens per request) and
IDLE batches of up to the profile's request cap (> 32 requests in a large share of draws), mixed
adapters, ranks and σ, sentinel expert ids, dense outputs contiguous or column slices of one fused
q|k|v buffer — run once in the mode (graph modes: captured on this batch, with drawn slack
capacity). Half the cases have two MoE layers after the one ``prepare``: layer 2 with its own base
weights, its own pool (same adapters in the same slots, other values) and its own routing, on layer
1's output after the harness's RMS norm (graph modes: both in the captured program). Checked:
every MoE layer's output (and layer 2's input: the norm of layer 1's output) and every dense
output against the oracle, the MoE and dense LoRA deltas against the oracle's, base rows
bit-identical to the LoRA-disabled run, the fused buffer's guard columns untouched, and (graph
modes) every pad row past the live tokens bit-identical to the LoRA-disabled run. In the ``gpu``
profile one eager example in 16 is the large-offset case (element offsets past 2³¹ in the MoE and
dense outputs: ``strategies.large_offsets``).
"""

from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.properties.registry import conformance
from moelora_conformance.properties.support import Subject, draw_capacity, draw_case, draw_moe_path


@conformance("P01")
@given(data=st.data())
def test_every_output_row_equals_the_oracle(moelora_suite, mode, dtype, data):
    case = draw_case(data, moelora_suite, mode, dtype, moe_layers=(1, 2), large_offsets=True)
    path = draw_moe_path(data, moelora_suite)
    capacity = draw_capacity(data, mode, [case.batch])
    subject = Subject(moelora_suite, case, mode, path, capacity)
    subject.run_and_check(subject.inputs(), "the drawn batch")
