"""BatchSpec: validation errors name the field; derived host lists match the requests.

Covers: slot outside [-1, max_loras); negative / zero lengths; DECODE with unequal lengths;
IDLE with requests; rank/σ table lengths; lengths that do not sum to the token count; the -1
sentinel never confused with slot 0; rank-0 slots behaving as base; the previous version's names
(``Request.adapter_id``, ``BatchSpec.req_to_lora``, ``effective_adapter``) and ``LoRABatchInfo``'s
removed fields raising an error that names their replacement.
"""

import pytest

from moelora_core import NO_ADAPTER, BatchSpec, ForwardMode, InvalidFieldError, Request

RANKS = (8, 4, 0)
SCALINGS = (2.0, 0.5, 0.0)


def spec(mode=ForwardMode.EXTEND, reqs=(Request(0, 3), Request(NO_ADAPTER, 2)), **kw):
    return BatchSpec(mode, reqs, kw.pop("max_loras", 3), kw.pop("lora_ranks", RANKS), kw.pop("scalings", SCALINGS))


@pytest.mark.parametrize(
    ("reqs", "field"),
    [
        ((Request(3, 1),), "requests[0].slot"),  # == max_loras
        ((Request(0, 1), Request(-2, 1)), "requests[1].slot"),  # below the sentinel
        ((Request(0, -1),), "requests[0].extend_len"),  # negative length
        ((Request(0, 0),), "requests[0].extend_len"),  # empty request
        ((Request(0, 1, prefix_len=-5),), "requests[0].prefix_len"),
        ((Request(True, 1),), "requests[0].slot"),  # bool is not a slot
    ],
)
def test_invalid_request_fields_are_named(reqs, field):
    with pytest.raises(InvalidFieldError) as exc:
        spec(reqs=reqs)
    assert exc.value.field == field
    assert field in str(exc.value)


def test_decode_needs_equal_lengths():
    with pytest.raises(InvalidFieldError, match=r"requests\[\*\]\.extend_len"):
        spec(ForwardMode.DECODE, (Request(0, 1), Request(1, 2)))


def test_idle_has_no_requests_and_extend_has_some():
    with pytest.raises(InvalidFieldError, match="IDLE"):
        spec(ForwardMode.IDLE, (Request(0, 1),))
    with pytest.raises(InvalidFieldError, match="at least one request"):
        spec(ForwardMode.EXTEND, ())
    idle = spec(ForwardMode.IDLE, ())
    assert idle.num_tokens == 0 and idle.token_lora_mapping == () and not idle.has_active_lora


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"lora_ranks": (8, 4)}, "lora_ranks"),
        ({"scalings": (1.0,)}, "scalings"),
        ({"lora_ranks": (8, -1, 0)}, "lora_ranks[1]"),
        ({"scalings": (1.0, float("nan"), 0.0)}, "scalings[1]"),
        ({"max_loras": 0, "lora_ranks": (), "scalings": ()}, "max_loras"),
    ],
)
def test_pool_tables_validated(kw, field):
    with pytest.raises(InvalidFieldError) as exc:
        spec(**kw)
    assert exc.value.field == field


def test_lengths_must_sum_to_token_count():
    b = spec()
    b.check_num_tokens(5)
    with pytest.raises(InvalidFieldError, match="sum to 5 tokens"):
        b.check_num_tokens(6)


def test_derived_host_lists():
    reqs = (Request(1, 2), Request(NO_ADAPTER, 1), Request(0, 3), Request(2, 2), Request(0, 1))
    b = spec(reqs=reqs)
    assert b.num_tokens == 9
    assert b.req_seg_indptr == (0, 2, 3, 6, 8, 9)
    # slot 2 has rank 0: its request behaves as a base request
    assert b.req_weight_indices == (1, -1, 0, -1, 0)
    assert b.token_lora_mapping == (1, 1, -1, 0, 0, 0, -1, -1, 0)
    assert b.adapter_enabled == (1, 1, 0)
    assert b.has_active_lora


def test_slot_zero_is_not_the_base_sentinel():
    b = spec(reqs=(Request(0, 1), Request(NO_ADAPTER, 1)))
    assert b.token_lora_mapping == (0, -1)
    assert b.adapter_enabled == (1, 0, 0)
    base_only = spec(reqs=(Request(NO_ADAPTER, 4),))
    assert not base_only.has_active_lora and base_only.adapter_enabled == (0, 0, 0)


def test_tokens_per_request_is_decode_only():
    assert spec(ForwardMode.DECODE, (Request(0, 2), Request(1, 2))).tokens_per_request == 2
    with pytest.raises(InvalidFieldError, match="forward_mode"):
        spec().tokens_per_request  # noqa: B018


@pytest.mark.parametrize("bad", ["x", None, True, 1e39, float("nan")])
def test_scalings_must_be_fp32_numbers(bad):
    # Regression: 'x' raised a raw ValueError; 1e39 was accepted and became Inf when staged as fp32.
    with pytest.raises(InvalidFieldError, match=r"scalings\[1\]"):
        spec(scalings=(2.0, bad, 0.0))


def test_old_names_name_their_replacement():
    from moelora_core import LoRABatchInfo, RenamedError

    b = spec()
    for call, new in ((lambda: Request(0, 3).adapter_id, "Request.slot"),
                      (lambda: Request(adapter_id=0, extend_len=3), r"Request\(slot=...\)"),
                      (lambda: b.req_to_lora, "BatchSpec.req_weight_indices"),
                      (lambda: b.effective_adapter(0), "BatchSpec.effective_slot")):
        with pytest.raises(RenamedError, match=new):
            call()
    assert Request(slot=1, extend_len=2) == Request(1, 2, 0) and b.req_weight_indices == (0, NO_ADAPTER)
    with pytest.raises(ImportError, match="token_lora_mapping, adapter_enabled"):
        from moelora_core import MoELoRABatchInfo  # noqa: F401
    with pytest.raises(RenamedError, match=r"LoRABatchInfo\(seg_lens=...\).*seg_indptr\[1:\]"):
        LoRABatchInfo(seg_lens=None)
