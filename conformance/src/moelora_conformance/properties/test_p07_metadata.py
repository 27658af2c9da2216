"""P07: metadata is exact — the per-token mapping equals the requests expanded, per-request fields
are valid whatever the segmentation, the dense segmentation covers each adapter token once, each
alignment block holds one expert, and graph tails are reset.

Eager: the drawn batch. Graph families: the drawn batch, a drawn larger batch, the drawn batch in
the smallest bucket that holds it, and an IDLE batch in the whole family, in the same static buffers
— each prepared batch must read exactly as if it were the first (tails reset to -1 / the last live
offset, in a bucket's views too, which the larger batch wrote; launch counts that still cover the
larger batch's segments). The alignment is checked over every token row the kernels see (graph
mode: the whole capacity of the family or bucket, pad rows mapped to -1).
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.harness import CheckContext, derive_inputs
from moelora_conformance.harness.inputs import pad_rows
from moelora_conformance.harness.layer import Layer
from moelora_conformance.harness.metadata import check_batch_metadata, check_moe_alignment
from moelora_conformance.properties.history import draw_batch
from moelora_conformance.properties.registry import conformance
from moelora_conformance.properties.support import capacity_for, draw_case, not_fallback, trace
from moelora_core.batch import BatchSpec
from moelora_core.forward_mode import ForwardMode


@conformance("P07")
@given(data=st.data())
def test_metadata_is_exact(moelora_suite, mode, dtype, data):
    suite = moelora_suite
    case = draw_case(data, suite, mode, dtype)
    b = case.batch
    layer = Layer(suite.factory, case, suite.device)
    backend, spec = layer.backend, layer.spec
    ctx = CheckContext(case.describe(), case.seed, case.dtype, suite.device)
    block_m = data.draw(st.sampled_from((16, 32, 64)), label="BLOCK_M of the twin alignment")
    if mode == "eager":
        batches = [(b, None)]
        family = None
    else:
        family = mode
        larger = draw_batch(data, suite, b, family, min_requests=b.bs + 1, label="larger batch")
        idle = BatchSpec(ForwardMode.IDLE, (), b.max_loras, b.lora_ranks, b.scalings)
        cap = capacity_for(family, [b, larger], extra_requests=data.draw(st.integers(0, 3), label="request slack"),
                           extra_tokens=data.draw(st.integers(0, 16), label="token slack"))
        bucket = capacity_for(family, [b])
        # a count frozen on the first batch, then tails after a larger one: in a smaller bucket's views,
        # and in the whole family (an IDLE batch leaves nothing live: every entry is a tail)
        batches = [(b, None), (larger, None), (b, bucket), (idle, None)]
        trace(f"capacity: {cap}; bucket of batch 2: {bucket}")
        backend.init_graph(family, cap)
    for i, (batch, bucket) in enumerate(batches):
        trace(f"batch {i}: {batch.forward_mode.name} bs={batch.bs} T={batch.num_tokens} "
              f"slots={list(batch.req_weight_indices)}{'' if bucket is None else f' in bucket {bucket}'}")
        info = not_fallback(backend.prepare(batch, family, bucket), f"{mode} batch {i}")
        check_batch_metadata(info, batch, ctx, graph=family is not None, num_experts=spec.E, max_loras=spec.max_loras)
        inp = derive_inputs(case, layer.m, batch, seed=case.seed + i)
        ids = inp.topk_ids
        rows = info.token_lora_mapping.numel()
        if rows > batch.num_tokens:
            ids = torch.cat([ids, pad_rows(layer.m, rows, case.seed).topk_ids[batch.num_tokens:]])
        check_moe_alignment(backend, info, batch, ids, ctx, num_experts=spec.E, max_loras=spec.max_loras,
                            block_m=block_m)
