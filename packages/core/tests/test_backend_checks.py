"""moelora_core.backend_checks: the argument checks every backend shares.

Covers: a batch of another slot count or with a rank above R; capacity sizes that are not ints >= 1
(bool included); decode / prefill capacities from their constructors, and a capacity of the other
family's kind refused; every Fallback reason (non-DECODE batch in the decode family, another
tokens_per_request, too many requests, too many tokens) and the batches that fit (IDLE in the decode
family, exactly at capacity); a repeated init with the same capacity (no-op) and with another
(refused); a bucket within its family's capacity and one outside it; unknown and uninitialised
families; the previous version's name ``FamilyCapacity`` naming its replacement; weights of another
pool or dtype; unknown dense modules; argument shapes and topk_ids dtypes.
"""

from types import SimpleNamespace

import pytest
import torch

from moelora_core import BatchSpec, ForwardMode, InvalidFieldError, LoRALayerSpec, LoRAWeights, Request
from moelora_core.backend_checks import (
    GraphCapacity,
    check_batch,
    check_bucket,
    check_capacity,
    check_dense_module,
    check_init_sizes,
    check_shape,
    check_topk_ids,
    check_weights,
    initialised_family,
    needs_allocation,
)

L, R = 3, 8


def _spec(**kw):
    return LoRALayerSpec(hidden_size=16, moe_intermediate_size=8, num_experts=4, top_k=2,
                         dense_shapes={"q": (16, 12)}, max_loras=kw.pop("max_loras", L), max_rank=R, **kw)


def _batch(mode=ForwardMode.EXTEND, requests=(Request(0, 3), Request(-1, 2)), ranks=(8, 4, 0)):
    return BatchSpec(mode, requests, len(ranks), ranks, tuple(1.0 if r else 0.0 for r in ranks))


def _info(tokens):
    # The shape checks read only the info's token count.
    return SimpleNamespace(num_tokens=tokens)


def _field(call):
    with pytest.raises(InvalidFieldError) as exc:
        call()
    return exc.value.field


def test_a_batch_of_the_spec_passes_and_others_are_refused_by_field():
    check_batch(_batch(), _spec())
    assert _field(lambda: check_batch("batch", _spec())) == "batch"
    assert _field(lambda: check_batch(_batch(ranks=(8, 4)), _spec())) == "batch.max_loras"
    assert _field(lambda: check_batch(_batch(ranks=(8, 9, 0)), _spec())) == "batch.lora_ranks[1]"  # R + 1


@pytest.mark.parametrize("value", [0, -1, True, 2.0, "4", None])
def test_init_sizes_must_be_ints_of_at_least_one(value):
    assert _field(lambda: check_init_sizes({"max_bs": 4, "tokens_per_request": value})) == "tokens_per_request"
    assert _field(lambda: GraphCapacity.prefill(value, 4)) == "max_num_tokens"


def test_capacities_follow_their_constructors_and_fit_their_family():
    assert GraphCapacity.decode(5, 2) == GraphCapacity(5, 10, 2)
    assert GraphCapacity.prefill(40, 7) == GraphCapacity(7, 40, None)
    assert check_capacity("decode", GraphCapacity.decode(5, 2)) == GraphCapacity(5, 10, 2)
    with pytest.raises(InvalidFieldError, match=r"the prefill family takes GraphCapacity.prefill") as exc:
        check_capacity("prefill", GraphCapacity.decode(5))
    assert exc.value.field == "capacity"
    assert _field(lambda: check_capacity("decode", GraphCapacity.prefill(8, 2))) == "capacity"
    assert _field(lambda: check_capacity("decode", GraphCapacity(2, 5, 2))) == "capacity"  # 5 != 2 x 2
    assert _field(lambda: check_capacity("decode", (4, 1))) == "capacity"
    assert _field(lambda: check_capacity("verify", GraphCapacity.decode(4))) == "family"
    with pytest.raises(ImportError, match="renamed or removed: GraphCapacity"):
        from moelora_core.backend_checks import FamilyCapacity  # noqa: F401


def test_a_bucket_lies_within_its_family():
    family = GraphCapacity.prefill(32, 8)
    assert check_bucket("prefill", family, None) is family
    assert check_bucket("prefill", family, GraphCapacity.prefill(16, 8)) == GraphCapacity.prefill(16, 8)
    for outside in (GraphCapacity.prefill(48, 8), GraphCapacity.prefill(16, 9), GraphCapacity.decode(8)):
        assert _field(lambda outside=outside: check_bucket("prefill", family, outside)) == "bucket"
    assert _field(lambda: check_bucket("decode", GraphCapacity.decode(8, 2), GraphCapacity.decode(4, 1))) == "bucket"


@pytest.mark.parametrize("batch, reason", [
    (_batch(), "EXTEND batch in the decode graph family"),
    (_batch(ForwardMode.DECODE, [Request(0, 2)]), "tokens_per_request 2 != decode graph's 1"),
    (_batch(ForwardMode.DECODE, [Request(0, 1)] * 4), "4 requests > capacity 3 of the decode graph"),
])
def test_decode_fallback_reasons(batch, reason):
    assert GraphCapacity.decode(3, 1).fallback_reason(batch, "decode") == reason


def test_prefill_fallback_reasons_and_batches_that_fit():
    prefill = GraphCapacity.prefill(12, 3)
    assert prefill.fallback_reason(_batch(requests=[Request(0, 1)] * 4), "prefill") == \
        "4 requests > capacity 3 of the prefill graph"
    assert prefill.fallback_reason(_batch(requests=[Request(1, 13)]), "prefill") == \
        "13 tokens > capacity 12 of the prefill graph"
    assert prefill.fallback_reason(_batch(requests=[Request(0, 6), Request(-1, 4), Request(1, 2)])) is None  # full
    assert prefill.fallback_reason(_batch(ForwardMode.DECODE, [Request(0, 1)])) is None  # decode in prefill: fits
    decode = GraphCapacity.decode(3, 2)
    assert decode.fallback_reason(_batch(ForwardMode.IDLE, ())) is None
    assert decode.fallback_reason(_batch(ForwardMode.DECODE, [Request(0, 2)] * 3)) is None


def test_a_family_is_allocated_once():
    first = GraphCapacity.prefill(16, 2)
    assert needs_allocation(None, first, "prefill")
    assert not needs_allocation(first, GraphCapacity.prefill(16, 2), "prefill")
    with pytest.raises(InvalidFieldError, match="allocated once") as exc:
        needs_allocation(first, GraphCapacity.prefill(32, 2), "prefill")
    assert exc.value.field == "prefill"
    # (2, 2) and (4, 1) hold the same tokens: still other capacities
    with pytest.raises(InvalidFieldError, match="allocated once"):
        needs_allocation(GraphCapacity.decode(2, 2), GraphCapacity.decode(4, 1), "decode")


def test_only_initialised_families_are_found():
    families = {"decode": "decode state"}
    assert initialised_family(families, "decode") == "decode state"
    with pytest.raises(InvalidFieldError, match=r"call init_graph\('prefill', capacity\) first"):
        initialised_family(families, "prefill")
    with pytest.raises(InvalidFieldError, match="'verify'") as exc:
        initialised_family(families, "verify")
    assert exc.value.field == "family"


def test_weights_must_be_a_pool_of_the_spec():
    spec = _spec()
    check_weights(spec, LoRAWeights(spec))
    assert _field(lambda: check_weights(spec, object())) == "weights"
    assert _field(lambda: check_weights(spec, LoRAWeights(_spec(max_loras=2)))) == "weights"
    half = LoRAWeights(_spec(dtype=torch.float16))
    with pytest.raises(InvalidFieldError, match="dtype"):
        check_weights(spec, half)
    check_weights(spec, half, same_dtype=False)


def test_dense_modules_and_shapes():
    spec = _spec()
    assert check_dense_module(spec, "q") == (16, 12)
    assert _field(lambda: check_dense_module(spec, "v")) == "module"
    info = _info(5)
    check_shape(info, "x", torch.zeros(5, 16), (5, 16))
    with pytest.raises(InvalidFieldError, match=r"x: expected shape \(5, 16\) \(T = 5 rows.*got \(4, 16\)"):
        check_shape(info, "x", torch.zeros(4, 16), (5, 16))
    with pytest.raises(InvalidFieldError, match="got list"):
        check_shape(info, "x", [[0.0] * 16] * 5, (5, 16))


def test_topk_ids_shape_and_dtype():
    info = _info(3)
    assert check_topk_ids(info, torch.zeros(3, 2, dtype=torch.int16), 2) == 3  # any integer dtype by default
    kernel_dtypes = (torch.int32, torch.int64)
    assert check_topk_ids(info, torch.zeros(3, 2, dtype=torch.int64), 2, kernel_dtypes) == 3
    with pytest.raises(InvalidFieldError, match=r"int32 or int64, got torch\.int16"):
        check_topk_ids(info, torch.zeros(3, 2, dtype=torch.int16), 2, kernel_dtypes)
    with pytest.raises(InvalidFieldError, match=r"an integer tensor, got torch\.float32"):
        check_topk_ids(info, torch.zeros(3, 2), 2)
    assert _field(lambda: check_topk_ids(info, torch.zeros(3, 1, dtype=torch.int32), 2)) == "topk_ids"
