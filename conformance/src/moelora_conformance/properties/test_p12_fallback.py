"""P12: over capacity, ``prepare`` returns ``Fallback``, no static buffer was touched, and the eager
run is correct.

A graph family is initialised one size too small for the drawn batch (one request fewer, one token
fewer, or — decode — another tokens-per-request, or an EXTEND batch offered to the decode family),
a batch that fits is prepared first, and then the drawn batch: ``prepare`` must return a
``Fallback`` with a reason, every metadata buffer the fitting batch wrote must be unchanged, and the
drawn batch run eagerly must equal the oracle (deltas and base rows included).
"""

import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from moelora_conformance.harness.metadata import metadata_tensors
from moelora_conformance.properties.registry import conformance
from moelora_conformance.properties.support import Subject, draw_case, draw_moe_path, not_fallback, trace
from moelora_core.backend_checks import GraphCapacity
from moelora_core.batch import BatchSpec, Request
from moelora_core.capabilities import Fallback
from moelora_core.forward_mode import ForwardMode


def _batch(like: BatchSpec, mode: ForwardMode, requests) -> BatchSpec:
    return BatchSpec(mode, requests, like.max_loras, like.lora_ranks, like.scalings)


@conformance("P12")
@given(data=st.data())
def test_over_capacity_falls_back_and_touches_nothing(moelora_suite, mode, dtype, data):
    suite = moelora_suite
    family = mode
    kinds = ("decode",) if family == "decode" else ("extend", "mixed")
    if family == "decode" and "prefill" in suite.capabilities.graph_families:
        kinds = ("decode", "extend", "mixed")  # an EXTEND batch offered to the decode family
    case = draw_case(data, suite, "eager", dtype, kinds=kinds)
    path = draw_moe_path(data, suite)
    subject = Subject(suite, case, "eager", path)
    backend, b = subject.backend, case.batch
    first_req = b.requests[0]
    if family == "decode":
        if b.forward_mode is not ForwardMode.DECODE:
            over = "an EXTEND batch"
            backend.init_graph("decode", GraphCapacity.decode(b.bs, 1))
            fits = _batch(b, ForwardMode.DECODE, [Request(first_req.slot, 1, 1)])
        else:
            tpr = b.tokens_per_request
            options = (["requests"] if b.bs > 1 else []) + ["tokens per request"]
            over = data.draw(st.sampled_from(options), label="what overflows")
            if over == "requests":
                backend.init_graph("decode", GraphCapacity.decode(b.bs - 1, tpr))
                fits = _batch(b, ForwardMode.DECODE, b.requests[:1])
            else:
                backend.init_graph("decode", GraphCapacity.decode(b.bs, tpr + 1))
                fits = _batch(b, ForwardMode.DECODE, [Request(first_req.slot, tpr + 1, 1)])
    else:
        options = (["requests"] if b.bs > 1 else []) + (["tokens"] if b.num_tokens > 1 else [])
        assume(options)  # one request of one token: no smaller prefill capacity exists
        over = data.draw(st.sampled_from(options), label="what overflows")
        if over == "requests":
            backend.init_graph("prefill", GraphCapacity.prefill(b.num_tokens, b.bs - 1))
        else:
            backend.init_graph("prefill", GraphCapacity.prefill(max(1, b.num_tokens - 1), b.bs))
        fits = _batch(b, ForwardMode.EXTEND, [Request(first_req.slot, 1)])
    trace(f"{family} family one size too small ({over}); fitting batch: {list(fits.seq_lens)}")
    info = not_fallback(backend.prepare(fits, family), f"{family} fitting batch")
    before = {n: t.clone() for n, t in metadata_tensors(info).items()}
    result = backend.prepare(b, family)
    if not isinstance(result, Fallback) or not result.reason:
        raise AssertionError(f"{family}: prepare of a batch over capacity ({over}) returned {result!r}, expected a "
                             f"Fallback with a reason | {subject.ctx.describe}")
    for n, t in metadata_tensors(info).items():
        if not torch.equal(t, before[n]):
            raise AssertionError(f"{family}: prepare of a batch over capacity wrote {n} | {subject.ctx.describe}")
    subject.run_and_check(subject.inputs(), f"the eager run after the {family} Fallback")
