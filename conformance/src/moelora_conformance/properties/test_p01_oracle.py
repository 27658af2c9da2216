"""P01: every output row equals the oracle.

One drawn case per example — ragged EXTEND (fresh and chunked), DECODE (1–4 tokens per request) and
IDLE batches of up to the profile's request cap (> 32 requests in a large share of draws), mixed
adapters, ranks and σ, sentinel expert ids — run once in the mode (graph modes: captured on this
batch, with drawn slack capacity). Checked: the MoE output and every dense output against the
oracle, the MoE and dense LoRA deltas against the oracle's, base rows bit-identical to the
LoRA-disabled run, and (graph modes) every pad row past the live tokens bit-identical to it.
"""

from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.properties.registry import conformance
from moelora_conformance.properties.support import Subject, draw_capacity, draw_case, draw_moe_path


@conformance("P01")
@given(data=st.data())
def test_every_output_row_equals_the_oracle(moelora_suite, mode, dtype, data):
    case = draw_case(data, moelora_suite, mode, dtype)
    path = draw_moe_path(data, moelora_suite)
    capacity = draw_capacity(data, mode, [case.batch])
    subject = Subject(moelora_suite, case, mode, path, capacity)
    subject.run_and_check(subject.inputs(), "the drawn batch")
