"""LoRAWeights.load_slot: rank zero-padding, absent modules zeroed, σ kept apart, and every bad
input refused with a named error and no change to any slot.

Also the adversarial-input findings: σ / adapter_scaling that fp32 cannot hold (2), factors that
overflow the pool's dtype only after the cast (4), factors with autograd history (9), and the
unclear errors of 11 (meta factors, σ of the wrong type).
"""

import gc
import weakref

import pytest
import torch

from moelora_core import (
    ALL_MODULES,
    InvalidFieldError,
    LoRALayerSpec,
    LoRAWeights,
    ModuleLoRA,
    SlotError,
)

H, I, E, R, L = 12, 8, 3, 6, 3  # noqa: E741 - H != 2I so a transposed read is caught


def make_spec(dtype=torch.float32):
    return LoRALayerSpec(hidden_size=H, moe_intermediate_size=I, num_experts=E, top_k=2,
                         dense_shapes={"q": (H, 16), "o": (16, H)}, max_loras=L, max_rank=R, dtype=dtype)


def rand(gen, *shape):
    return torch.randn(*shape, generator=gen)


def adapter(gen, r=4, modules=("gate", "up", "down", "q", "o"), scaling=0.5):
    shapes = {"gate": (H, I), "up": (H, I), "down": (I, H), "q": (H, 16), "o": (16, H)}
    out = {}
    for m in modules:
        fin, fout = shapes[m]
        lead = (E,) if m in ("gate", "up", "down") else ()
        out[m] = ModuleLoRA(rand(gen, *lead, r, fin), rand(gen, *lead, fout, r), scaling)
    return out


def snapshot(w):
    tensors = [w.gate_up_A, w.gate_up_B, w.down_A, w.down_B, w.module_ranks, w.module_scalings,
               *w.dense_A.values(), *w.dense_B.values()]
    return [t.clone() for t in tensors], {m: list(v) for m, v in w.host_ranks.items()}


def assert_unchanged(w, snap):
    tensors, ranks = snapshot(w)
    for before, after in zip(snap[0], tensors):
        assert torch.equal(before, after)
    assert ranks == snap[1]


def test_load_pads_rank_and_zeroes_absent_modules():
    gen = torch.Generator().manual_seed(1)
    w = LoRAWeights(make_spec())
    ad = adapter(gen, r=4, modules=("gate", "down", "q"), scaling=0.25)
    w.load_slot(1, ad)
    assert torch.equal(w.gate_A[1, :, :4], ad["gate"].lora_A)
    assert torch.equal(w.gate_A[1, :, 4:], torch.zeros(E, R - 4, H))
    assert torch.equal(w.gate_B[1, :, :, :4], ad["gate"].lora_B)
    assert torch.equal(w.gate_B[1, :, :, 4:], torch.zeros(E, I, R - 4))
    assert torch.equal(w.up_A[1], torch.zeros(E, R, H))  # absent → zero
    assert torch.equal(w.dense_A["o"][1], torch.zeros(R, 16))
    assert w.host_ranks["gate"][1] == 4 and w.host_ranks["up"][1] == 0
    assert w.scalings("gate")[1].item() == 0.25 and w.scalings("up")[1].item() == 0.0
    assert w.slot_ranks() == (0, 4, 0)
    assert w.slot_scalings() == (0.0, 0.25, 0.0)
    # other slots untouched
    assert torch.count_nonzero(w.gate_up_A[:, 0]) == 0 and torch.count_nonzero(w.gate_up_A[:, 2]) == 0


def test_reload_replaces_and_never_scales_twice():
    gen = torch.Generator().manual_seed(2)
    w = LoRAWeights(make_spec())
    first = adapter(gen, r=6)
    w.load_slot(0, first)
    second = adapter(gen, r=2, modules=("up",), scaling=3.0)
    w.load_slot(0, second)
    assert torch.equal(w.up_B[0, :, :, :2], second["up"].lora_B)  # B stored unscaled
    assert torch.count_nonzero(w.gate_up_A[0, 0]) == 0  # gate from the first adapter is gone
    assert torch.count_nonzero(w.down_A[0]) == 0
    assert w.slot_rank(0) == 2


def test_fp16_adapter_cast_to_spec_dtype():
    gen = torch.Generator().manual_seed(3)
    w = LoRAWeights(make_spec(torch.float32))
    ad = {m: ModuleLoRA(v.lora_A.half(), v.lora_B.half(), v.scaling) for m, v in adapter(gen).items()}
    w.load_slot(2, ad)
    assert w.gate_A.dtype == torch.float32
    assert torch.equal(w.gate_A[2, :, :4], ad["gate"].lora_A.float())


def test_views_share_storage_and_virtual_expert_reshape_is_free():
    w = LoRAWeights(make_spec())
    assert w.gate_A.data_ptr() == w.gate_up_A.data_ptr()
    assert w.up_A.data_ptr() == w.gate_up_A[1].data_ptr()
    v = w.down_A.view(L * E, R, I)  # (slot, expert) → slot·E + expert without a copy
    assert v.data_ptr() == w.down_A.data_ptr()


def _bad_cases(gen):
    good = adapter(gen)
    cases = {
        "rank above R": ({"gate": ModuleLoRA(rand(gen, E, R + 1, H), rand(gen, E, I, R + 1), 1.0)}, "adapter['gate'].rank"),
        "transposed A": ({"gate": ModuleLoRA(rand(gen, E, H, 4), rand(gen, E, I, 4), 1.0)}, "adapter['gate'].lora_A"),
        "B rank mismatch": ({"down": ModuleLoRA(rand(gen, E, 4, I), rand(gen, E, H, 3), 1.0)}, "adapter['down'].lora_B"),
        "missing expert dim": ({"up": ModuleLoRA(rand(gen, 4, H), rand(gen, I, 4), 1.0)}, "adapter['up'].lora_A"),
        "unknown module": ({"gate_up": good["gate"]}, "adapter['gate_up']"),
        "module not in spec": ({"k": ModuleLoRA(rand(gen, 4, H), rand(gen, 8, 4), 1.0)}, "adapter['k']"),
        "NaN in B": ({"q": ModuleLoRA(good["q"].lora_A, good["q"].lora_B.clone().fill_(float("nan")), 1.0)}, "adapter['q'].lora_B"),
        "Inf σ": ({"q": ModuleLoRA(good["q"].lora_A, good["q"].lora_B, float("inf"))}, "adapter['q'].scaling"),
        "integer A": ({"q": ModuleLoRA(good["q"].lora_A.int(), good["q"].lora_B, 1.0)}, "adapter['q'].lora_A"),
        "empty": ({}, "adapter"),
        # Regression: a meta tensor crashed in .item(); σ None raised TypeError, '2.0' and True were taken
        "meta A": ({"q": ModuleLoRA(torch.empty(4, H, device="meta"), good["q"].lora_B, 1.0)}, "adapter['q'].lora_A"),
        "σ None": ({"q": ModuleLoRA(good["q"].lora_A, good["q"].lora_B, None)}, "adapter['q'].scaling"),
        "σ str": ({"q": ModuleLoRA(good["q"].lora_A, good["q"].lora_B, "2.0")}, "adapter['q'].scaling"),
        "σ bool": ({"q": ModuleLoRA(good["q"].lora_A, good["q"].lora_B, True)}, "adapter['q'].scaling"),
        "not a mapping": ([("q", good["q"])], "adapter"),
    }
    # a valid module next to a bad one: nothing of the valid one may land either
    cases["good then bad"] = ({"gate": good["gate"], "down": cases["B rank mismatch"][0]["down"]}, "adapter['down'].lora_B")
    return cases


@pytest.mark.parametrize("case", list(_bad_cases(torch.Generator().manual_seed(0))))
def test_bad_adapter_refused_and_nothing_changes(case):
    gen = torch.Generator().manual_seed(4)
    w = LoRAWeights(make_spec())
    w.load_slot(1, adapter(gen, r=3))
    before = snapshot(w)
    bad, field = _bad_cases(torch.Generator().manual_seed(5))[case]
    with pytest.raises(InvalidFieldError) as exc:
        w.load_slot(1, bad)
    assert exc.value.field == field, str(exc.value)
    if bad and isinstance(bad, dict):  # validate refuses what load_slot refuses, with the same field (an empty adapter only checks the slot)
        with pytest.raises(InvalidFieldError) as exc:
            w.validate(1, bad)
        assert exc.value.field == field, str(exc.value)
    assert_unchanged(w, before)


def test_validate_returns_the_checked_modules_and_writes_nothing():
    gen = torch.Generator().manual_seed(7)
    w = LoRAWeights(make_spec())
    before = snapshot(w)
    ad = adapter(gen, r=2, modules=("down", "q"))
    checked = w.validate(2, ad)
    assert list(checked) == ["down", "q"] and all(checked[m] is ad[m] for m in ad)
    assert w.validate(0, {}) == {}  # the slot alone
    assert_unchanged(w, before)


@pytest.mark.parametrize("slot", [-1, L, 1.0, True])
def test_slot_out_of_range(slot):
    w = LoRAWeights(make_spec())
    before = snapshot(w)
    with pytest.raises(SlotError, match="slot"):
        w.load_slot(slot, adapter(torch.Generator().manual_seed(6)))
    with pytest.raises(SlotError):
        w.clear_slot(slot)
    with pytest.raises(SlotError):
        w.validate(slot, {})
    assert_unchanged(w, before)


def test_module_tables_cover_every_module():
    w = LoRAWeights(make_spec())
    assert w.module_ranks.shape == (len(ALL_MODULES), L)
    assert w.module_ranks.dtype == torch.int32 and w.module_scalings.dtype == torch.float32


# --- adversarial-input findings ------------------------------------------------------------------


@pytest.mark.parametrize("sigma", [1e39, -1e39, 3.5e38])
def test_sigma_overflowing_fp32_is_refused_and_changes_nothing(sigma):
    # Regression: σ = 1.25e39 is a finite Python float but not an fp32 one; load_slot cleared the
    # slot, then raised a raw RuntimeError half-way through writing the σ table.
    gen = torch.Generator().manual_seed(8)
    w = LoRAWeights(make_spec())
    w.load_slot(1, adapter(gen, r=3))
    before = snapshot(w)
    bad = adapter(gen, r=2, modules=("gate", "q"))
    bad["q"] = ModuleLoRA(bad["q"].lora_A, bad["q"].lora_B, sigma)
    with pytest.raises(InvalidFieldError, match=r"adapter\['q'\]\.scaling: .*fp32") as exc:
        w.load_slot(1, bad)
    assert exc.value.field == "adapter['q'].scaling"
    assert_unchanged(w, before)


@pytest.mark.parametrize("adapter_scaling", [float("nan"), float("inf"), 1e39, "abc", "2.0", True])
def test_bad_adapter_scaling_is_refused_and_changes_nothing(adapter_scaling):
    # Regression: a non-finite, fp32-overflowing or non-numeric adapter_scaling must be refused
    # with a named error before the slot is cleared ('abc' was a raw ValueError).
    gen = torch.Generator().manual_seed(9)
    w = LoRAWeights(make_spec())
    w.load_slot(0, adapter(gen, r=3))
    before = snapshot(w)
    with pytest.raises(InvalidFieldError) as exc:
        w.load_slot(0, adapter(gen, r=2), adapter_scaling=adapter_scaling)
    assert exc.value.field == "adapter_scaling", str(exc.value)
    assert_unchanged(w, before)


def test_factors_overflowing_the_pool_dtype_are_refused_after_the_cast():
    # Regression: fp32 factors with |B| ~ 1e5 are finite, but Inf in an fp16 pool; load_slot checked
    # finiteness before its cast and left 236 Inf in q's B.
    gen = torch.Generator().manual_seed(10)
    w = LoRAWeights(make_spec(torch.float16))
    w.load_slot(2, adapter(gen, r=3))
    before = snapshot(w)
    bad = adapter(gen, r=2, modules=("gate", "q"))
    bad["q"] = ModuleLoRA(bad["q"].lora_A, bad["q"].lora_B * 1e6, 1.0)
    with pytest.raises(InvalidFieldError, match=r"overflows the pool's float16 when cast from float32") as exc:
        w.load_slot(2, bad)
    assert exc.value.field == "adapter['q'].lora_B"
    with pytest.raises(InvalidFieldError, match="overflows"):
        w.validate(2, bad)
    assert_unchanged(w, before)
    assert bool(torch.isfinite(w.dense_B["q"]).all())


def test_pool_keeps_no_autograd_history_and_no_caller_tensor():
    # Regression: nn.Parameter factors made the pool buffers require grad (grad_fn CopySlices), kept
    # the caller's tensors alive through the graph, and survived clear_slot and reloads.
    gen = torch.Generator().manual_seed(11)
    w = LoRAWeights(make_spec())
    params = {m: ModuleLoRA(torch.nn.Parameter(v.lora_A), torch.nn.Parameter(v.lora_B), v.scaling)
              for m, v in adapter(gen, r=3).items()}
    alive = weakref.ref(params["q"].lora_A)
    w.load_slot(0, params)
    tensors = [w.gate_up_A, w.gate_up_B, w.down_A, w.down_B, w.module_ranks, w.module_scalings,
               *w.dense_A.values(), *w.dense_B.values()]
    assert not any(t.requires_grad or t.grad_fn is not None for t in tensors)
    assert torch.equal(w.dense_A["q"][0, :3], params["q"].lora_A.detach())
    del params
    gc.collect()
    assert alive() is None  # the pool copied the values and kept nothing of the caller's


def test_pool_built_in_inference_mode_loads_outside_it():
    # A serving engine may build its pools under torch.inference_mode(); in-place writes into
    # inference tensors outside that mode raise, so the buffers must be ordinary tensors.
    gen = torch.Generator().manual_seed(12)
    with torch.inference_mode():
        w = LoRAWeights(make_spec())
        w.load_slot(1, adapter(gen, r=2))
    ad = adapter(gen, r=4)
    w.load_slot(1, ad)
    assert torch.equal(w.gate_A[1, :, :4], ad["gate"].lora_A)
    assert not w.gate_up_A.is_inference()
