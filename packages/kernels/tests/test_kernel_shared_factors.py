"""Shared-outer and fully shared expert factors: stored once per slot, read with expert stride 0.

Covers, for the pool layouts "shared_outer" (gate_up A and down B once per slot) and
"fully_shared" (all four once per slot):

- the pool stores a shared factor as ``[.., L, 1, ..]`` and exposes it as an expert-stride-0 view
  of that same memory (no expand-copy); a per-expert factor into a shared buffer is refused and
  changes nothing;
- the fused and the two-launch MoE-LoRA kernels, and the virtual-experts path, on such a pool equal
  (a) their twins reading the same stride-0 views and (b) the same kernels on a per-expert pool
  holding the same factors broadcast to every expert (the per-module reference), rows the delta
  must not touch bit-identical;
- the whole layer with LoRA against the fp64 oracle fed the per-expert pool.
"""

import pytest
import torch
from kernel_testing import DEVICE, assert_close, cpu, launch_guard
from moe_lora_testing import (
    check_delta,
    cpu_weights,
    drawn_adapters,
    enabled_of,
    handled,
    load_slots,
    run_delta,
    stage_inputs,
    twin_delta,
)

from moelora_core import EXPERT_FACTORS, EXPERT_LAYOUTS, InvalidFieldError, LoRALayerSpec, LoRAWeights, ModuleLoRA
from moelora_kernels import (
    STAGES,
    MoELoRAInputs,
    fused_moe,
    moe_block_m,
    moe_lora_align_block_size,
    stage_tensors,
    virtual_align,
    virtual_moe_lora_delta,
)
from moelora_reference.oracle import moe_lora_forward

pytestmark = pytest.mark.interpreter

SHARED_LAYOUTS = ("shared_outer", "fully_shared")
# bf16 only on a GPU: the interpreter computes bf16 wrongly
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type != "cpu" else [])


def _pools(seed, layout, *, L=3, E=5, H=40, I=24, R=16, ranks=None, dtype=torch.float32):
    """(pool in ``layout``, per-expert pool with the same factors broadcast): both from one draw."""
    gen = torch.Generator().manual_seed(seed)
    spec = LoRALayerSpec(hidden_size=H, moe_intermediate_size=I, num_experts=E, top_k=2, dense_shapes={}, max_loras=L,
                         max_rank=R, dtype=dtype, device=DEVICE, expert_layout=layout)
    adapters = drawn_adapters(spec, gen, ranks, layout=layout)
    shared = load_slots(LoRAWeights(spec), adapters)
    per_expert = load_slots(LoRAWeights(LoRALayerSpec(**{**_fields(spec), "expert_layout": "per_expert"})), adapters)
    return shared, per_expert


def _fields(spec):
    return {f: getattr(spec, f) for f in ("hidden_size", "moe_intermediate_size", "num_experts", "top_k",
                                          "dense_shapes", "max_loras", "max_rank", "dtype", "device")}


def _problem(seed, spec, M=9, k=2):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(spec.E, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    mapping = torch.randint(-1, spec.max_loras, (M,), generator=gen, dtype=torch.int32)
    mapping[0] = 0  # at least one adapter token
    tw = torch.rand(M, k, generator=gen)
    return gen, ids.to(DEVICE), mapping.to(DEVICE), tw.to(DEVICE)


@pytest.mark.parametrize("layout", SHARED_LAYOUTS)
def test_shared_factor_is_stored_once_and_read_with_expert_stride_zero(layout):
    w, _ = _pools(1, layout)
    E, R, H, I = 5, 16, 40, 24
    for f in EXPERT_FACTORS:
        store, view = w.storage(f), getattr(w, f)
        if f in EXPERT_LAYOUTS[layout]:
            assert store.shape[-3] == 1, f"{f} stored {store.shape[-3]} times per slot"
            assert view.stride(-3) == 0 and view.shape[-3] == E
            assert view.data_ptr() == store.data_ptr(), f"{f}: the view is not the stored buffer"
        else:
            assert store.shape[-3] == E and view is store
    per_expert_bytes = (2 * E * R * H + 2 * E * I * R + E * R * I + E * H * R) * 4
    saved = {"shared_outer": (2 * (E - 1) * R * H + (E - 1) * H * R) * 4,
             "fully_shared": (E - 1) * (2 * R * H + 2 * I * R + R * I + H * R) * 4}[layout]
    assert w.slot_bytes() == per_expert_bytes - saved


@pytest.mark.parametrize("layout", SHARED_LAYOUTS)
def test_per_expert_factor_into_a_shared_buffer_is_refused_and_changes_nothing(layout):
    w, _ = _pools(2, layout)
    before = {f: w.storage(f).clone() for f in EXPERT_FACTORS}
    E, R = w.spec.E, w.spec.R
    bad = {"gate": ModuleLoRA(torch.randn(E, R, w.spec.H), torch.randn(1 if layout == "fully_shared" else E,
                                                                         w.spec.I, R), 1.0)}
    with pytest.raises(InvalidFieldError, match="once per slot"):
        w.load_slot(0, bad)
    for f in EXPERT_FACTORS:
        assert torch.equal(w.storage(f), before[f]), f"{f} changed by a refused load"


@pytest.mark.parametrize("layout", SHARED_LAYOUTS)
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_stride_zero_delta_matches_twin_and_per_expert_pool(layout, stage, fused, dtype):
    # mixed ranks: slot 2 has no down module, so its down rows stay bit-identical
    ranks = {0: {"gate": 16, "up": 7, "down": 5}, 1: {"gate": 3, "up": 3, "down": 16}, 2: {"gate": 8, "up": 2}}
    w, ref = _pools(3, layout, ranks=ranks, dtype=dtype)
    spec = w.spec
    gen, ids, mapping, tw = _problem(3, spec)
    M, k = ids.shape
    enabled = enabled_of(mapping, spec.max_loras)
    with launch_guard():
        align = moe_lora_align_block_size(ids, mapping, spec.E, 32, spec.max_loras, enabled)
    x, out0, tw = stage_inputs(gen, stage, M, k, spec.H, spec.I, spec.dtype, tw)
    out = run_delta(stage, x, out0.clone(), w, align, k, tw, enabled, fused)
    mask = handled(stage, ids, mapping, enabled, stage_tensors(w, stage)["ranks"], spec.E)
    want = twin_delta(stage, x, out0, w, align, k, tw, enabled)
    check_delta(stage, out, want, out0, mask, spec.dtype, 3, f"{layout} {stage} fused={fused} vs twin")
    per_expert = run_delta(stage, x, out0.clone(), ref, align, k, tw, enabled, fused)
    check_delta(stage, out, per_expert, out0, mask, spec.dtype, 3, f"{layout} {stage} vs per-expert pool")


@pytest.mark.parametrize("layout", SHARED_LAYOUTS)
@pytest.mark.parametrize("stage", STAGES)
def test_virtual_experts_read_the_shared_factor_in_place(layout, stage):
    w, ref = _pools(4, layout, L=2)
    spec = w.spec
    gen, ids, mapping, tw = _problem(4, spec)
    M, k = ids.shape
    with launch_guard():
        _, valign = virtual_align(ids, mapping, spec.E, spec.max_loras)
    x, out0, tw = stage_inputs(gen, stage, M, k, spec.H, spec.I, spec.dtype, tw)
    out = out0.clone()
    with launch_guard():
        virtual_moe_lora_delta(stage, x, out, w, valign, top_k=k, topk_weights=tw)
    want = out0.clone()
    with launch_guard():
        virtual_moe_lora_delta(stage, x, want, ref, valign, top_k=k, topk_weights=tw)
    ones = torch.ones(spec.max_loras, dtype=torch.int32)
    mask = handled(stage, ids, mapping, ones, stage_tensors(w, stage)["ranks"], spec.E)
    check_delta(stage, out, want, out0, mask, spec.dtype, 4, f"virtual {layout} {stage} vs per-expert pool")
    # a change to the one stored copy shows for every expert of the slot: it is read, not copied
    factor = "gate_up_A" if stage == "gate_up" else "down_B"  # shared in both layouts
    w.storage(factor).mul_(2.0)
    again = out0.clone()
    with launch_guard():
        virtual_moe_lora_delta(stage, x, again, w, valign, top_k=k, topk_weights=tw)
    rows = mask.any(dim=0).reshape(M, k).cpu()
    assert bool((again.cpu() != out.cpu()).any(dim=-1)[rows].all()), "a pair did not read the stored factor"


@pytest.mark.parametrize("layout", SHARED_LAYOUTS)
def test_layer_on_a_shared_pool_matches_oracle_on_per_expert_factors(layout):
    w, ref = _pools(5, layout)
    spec = w.spec
    gen, ids, mapping, tw = _problem(5, spec, M=7)
    x = torch.randn(7, spec.H, generator=gen).to(DEVICE)
    w_gate_up = (torch.randn(spec.E, 2 * spec.I, spec.H, generator=gen) / spec.H ** 0.5).to(DEVICE)
    w_down = (torch.randn(spec.E, spec.H, spec.I, generator=gen) / spec.I ** 0.5).to(DEVICE)
    M, k = ids.shape
    with launch_guard():
        align = moe_lora_align_block_size(ids, mapping, spec.E, moe_block_m(M, k, spec.E, spec.max_loras),
                                          spec.max_loras)
        y = fused_moe(x, ids, tw, w_gate_up, w_down, deltas=MoELoRAInputs(w, align))
    want = moe_lora_forward(cpu(x), cpu(ids), cpu(tw), cpu(w_gate_up), cpu(w_down), cpu_weights(ref), cpu(mapping))
    assert_close(y, want, dtype=torch.float32, what=f"{layout} layer vs oracle", seed=5)
