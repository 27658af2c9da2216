"""LoRAWeights.load_slot: rank zero-padding, absent modules zeroed, σ kept apart, and every bad
input refused with a named error and no change to any slot."""

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
    return LoRALayerSpec(H, I, E, 2, {"q": (H, 16), "o": (16, H)}, max_loras=L, max_rank=R, dtype=dtype)


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
    if bad:  # validate refuses what load_slot refuses, with the same field (an empty adapter only checks the slot)
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
