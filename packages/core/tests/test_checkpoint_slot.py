"""load_adapter_into_slot: one adapter into one slot of every layer's pool, atomically.

Covers: every layer written, untouched layers cleared in that slot, a second adapter replaces the
first completely, other slots untouched, and refusals (rank > R, pools of another model, wrong
layer count, bad slot) that leave every pool bit-identical, host lists included.
"""

import dataclasses

import pytest
import torch

from moelora_core import InvalidFieldError, LoRAWeights, ModuleLoRA, SlotError
from moelora_core.checkpoint import (
    ModelMismatchError,
    MoEModelConfig,
    NonFiniteWeightError,
    RankTooLargeError,
    load_adapter_into_slot,
)
from moelora_core.checkpoint.adapter_reader import read_adapter
from moelora_core.checkpoint.synthetic import adapter_tensors, model_config_dict, write_adapter

DIMS = dict(hidden=24, inter=16, experts=4, top_k=2, heads=2, kv_heads=1, head_dim=10, layers=3)


def _cfg(**over):
    return MoEModelConfig.from_dict(model_config_dict("qwen3_moe", **{**DIMS, **over}))


def _adapter(tmp_path, cfg, name, layers, r, seed, alpha=None):
    gen = torch.Generator().manual_seed(seed)
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts  # noqa: E741
    per_layer = {}
    for li, modules in layers.items():
        a = torch.randn(E, r, H, generator=gen)
        f = {"gate": (a, torch.randn(E, I, r, generator=gen)), "up": (a.clone(), torch.randn(E, I, r, generator=gen)),
             "down": (torch.randn(E, r, I, generator=gen), torch.randn(E, H, r, generator=gen)),
             "q": (torch.randn(r, H, generator=gen), torch.randn(20, r, generator=gen)),
             "o": (torch.randn(r, 20, generator=gen), torch.randn(H, r, generator=gen))}
        per_layer[li] = {m: f[m] for m in modules}
    tensors, targets = adapter_tensors(cfg, per_layer)
    conf = {**targets, "r": r, "lora_alpha": alpha or 2 * r, "target_parameters": targets["target_parameters"] or None}
    return read_adapter(write_adapter(tmp_path / name, tensors, conf), cfg, name=name), per_layer


def _pools(cfg, R=8, max_loras=3):
    return [LoRAWeights(cfg.layer_spec(max_loras=max_loras, max_rank=R)) for _ in range(cfg.num_layers)]


def _snapshot(pools):
    snap = []
    for p in pools:
        tensors = [p.gate_up_A, p.gate_up_B, p.down_A, p.down_B, p.module_ranks, p.module_scalings,
                   *p.dense_A.values(), *p.dense_B.values()]
        snap.append(([t.clone() for t in tensors], repr(p.host_ranks), repr(p.host_scalings),
                     list(p.host_adapter_scalings)))
    return snap


def _assert_unchanged(pools, snap):
    for before, after in zip(snap, _snapshot(pools)):
        for a, b in zip(before[0], after[0]):
            assert torch.equal(a, b)
        assert before[1:] == after[1:]


ALL = ("gate", "up", "down", "q", "o")


def test_loads_every_layer_and_clears_untouched_ones(tmp_path):
    cfg = _cfg()
    adapter, want = _adapter(tmp_path, cfg, "a", {0: ALL, 2: ("down", "q")}, r=3, seed=0)
    pools = _pools(cfg)
    other, _ = _adapter(tmp_path, cfg, "other", {0: ALL, 1: ALL, 2: ALL}, r=5, seed=1)
    load_adapter_into_slot(pools, 2, other)  # slot 2 holds another adapter: must stay as it is
    load_adapter_into_slot(pools, 1, other)  # slot 1's old contents must all go
    before_slot2 = _snapshot(pools)
    load_adapter_into_slot(pools, 1, adapter)
    for li, pool in enumerate(pools):
        for m in ALL:
            A, B = pool.factors(m)
            if m in want.get(li, {}):
                wa, wb = want[li][m]
                assert torch.equal(A[1, ..., :3, :], wa) and not A[1, ..., 3:, :].any()
                assert torch.equal(B[1, ..., :, :3], wb) and not B[1, ..., :, 3:].any()
                assert pool.host_ranks[m][1] == 3 and pool.scalings(m)[1] == 2.0
            else:  # absent here: zero, rank 0, σ 0 (nothing left of "other")
                assert not A[1].any() and not B[1].any()
                assert pool.host_ranks[m][1] == 0 and pool.scalings(m)[1] == 0.0
        assert pool.slot_rank(1) == (3 if li in want else 0)
        assert pool.host_adapter_scalings[1] == (2.0 if li in want else 0.0)
    for before, pool in zip(before_slot2, pools):  # slot 2 untouched
        assert torch.equal(before[0][0][:, 2], pool.gate_up_A[:, 2]) and torch.equal(before[0][2][2], pool.down_A[2])


@pytest.mark.parametrize(
    ("make", "kind", "fragment"),
    [
        (lambda cfg, ad: (_pools(cfg, R=4), 1, ad), RankTooLargeError, "rank above the pool's max rank"),
        (lambda cfg, ad: (_pools(cfg)[:2], 1, ad), ModelMismatchError, "one pool per decoder layer"),
        (lambda cfg, ad: (_pools(_cfg(inter=12)), 1, ad), ModelMismatchError, "factors do not fit"),
        (lambda cfg, ad: (_pools(cfg), 3, ad), SlotError, "slot"),
    ],
)
def test_refusal_changes_nothing(tmp_path, make, kind, fragment):
    cfg = _cfg()
    big, _ = _adapter(tmp_path, cfg, "big", {0: ALL, 1: ALL, 2: ("gate", "up")}, r=6, seed=2)
    pools, slot, adapter = make(cfg, big)
    small, _ = _adapter(tmp_path, cfg if pools[0].spec.I == 16 else _cfg(inter=12), "small",
                        {li: ALL for li in range(len(pools))}, r=2, seed=3)
    if len(pools) == cfg.num_layers:
        load_adapter_into_slot(pools, 1, small)
    snap = _snapshot(pools)
    with pytest.raises(kind, match=fragment):
        load_adapter_into_slot(pools, slot, adapter)
    _assert_unchanged(pools, snap)


def test_refusal_in_the_last_layer_leaves_the_first_untouched(tmp_path):
    # Only layer 2 has a rank above R: validation of all layers precedes the first write.
    cfg = _cfg()
    first, _ = _adapter(tmp_path, cfg, "ok", {0: ALL, 1: ALL}, r=2, seed=4)
    pools = _pools(cfg, R=4)
    load_adapter_into_slot(pools, 0, first)
    tensors, targets = adapter_tensors(cfg, {
        0: {"q": (torch.ones(2, 24), torch.ones(20, 2))},
        2: {"q": (torch.ones(6, 24), torch.ones(20, 6))},
    })
    ad = read_adapter(write_adapter(tmp_path / "mixed", tensors,
                                    {**targets, "r": 2, "lora_alpha": 2, "rank_pattern": {"layers.2.self_attn.q_proj": 6},
                                     "target_parameters": None}), cfg)
    snap = _snapshot(pools)
    with pytest.raises(RankTooLargeError, match=r"adapter 'mixed': layer 2 q: rank above the pool's max rank"):
        load_adapter_into_slot(pools, 0, ad)
    _assert_unchanged(pools, snap)


@pytest.mark.parametrize("adapter_scaling", [float("nan"), float("inf"), 1e39, "abc"])
def test_bad_adapter_scaling_refused_before_any_layer_is_cleared(tmp_path, adapter_scaling):
    # Regression: an adapter touching only layer 1, loaded with a bad adapter_scaling, cleared layer 0
    # of the slot and then refused in layer 1: the slot held nothing on layer 0 and the old adapter
    # on layer 1. Every argument is checked before the first write or clear.
    cfg = _cfg()
    only1, _ = _adapter(tmp_path, cfg, "only1", {1: ALL}, r=2, seed=5)
    old, _ = _adapter(tmp_path, cfg, "old", {0: ALL, 1: ALL, 2: ALL}, r=3, seed=6)
    pools = _pools(cfg)
    load_adapter_into_slot(pools, 0, old)
    snap = _snapshot(pools)
    with pytest.raises(InvalidFieldError, match="adapter_scaling"):
        load_adapter_into_slot(pools, 0, only1, adapter_scaling=adapter_scaling)
    _assert_unchanged(pools, snap)


def test_sigma_overflowing_fp32_refused_before_any_write(tmp_path):
    # Regression: σ = 1.25e39 (lora_alpha 1e40) is a finite Python float; the pool's fp32 σ table
    # cannot hold it. load_slot used to fail half-way (layer 0 slot 0 with device ranks
    # [0, 0, 8, 0, ...] and host ranks 0; layer 1 still the previous adapter).
    cfg = _cfg()
    good, _ = _adapter(tmp_path, cfg, "good", {0: ALL, 1: ALL, 2: ALL}, r=2, seed=7)
    old, _ = _adapter(tmp_path, cfg, "old", {0: ALL, 1: ALL, 2: ALL}, r=3, seed=8)
    layers = [dict(layer) for layer in good.layers]
    layers[1]["q"] = dataclasses.replace(layers[1]["q"], scaling=1.25e39)
    huge = dataclasses.replace(good, layers=tuple(layers))
    pools = _pools(cfg)
    load_adapter_into_slot(pools, 0, old)
    snap = _snapshot(pools)
    with pytest.raises(InvalidFieldError, match=r"adapter 'good' layer 1 q.*fp32"):
        load_adapter_into_slot(pools, 0, huge)
    _assert_unchanged(pools, snap)


def test_fp32_adapter_overflowing_fp16_pools_is_refused(tmp_path):
    # Regression: read_adapter returns fp32 by default; loading |B| ~ 1e5 into fp16 pools overflowed
    # in load_slot's cast (Inf in the pool, no error), while reading with dtype=fp16 was refused.
    cfg = _cfg()
    big, _ = _adapter(tmp_path, cfg, "big", {0: ALL, 2: ALL}, r=2, seed=9)
    layers = [dict(layer) for layer in big.layers]
    layers[2]["o"] = dataclasses.replace(layers[2]["o"], lora_B=layers[2]["o"].lora_B * 1e6)
    big = dataclasses.replace(big, layers=tuple(layers))
    pools = [LoRAWeights(cfg.layer_spec(max_loras=2, max_rank=8, dtype=torch.float16)) for _ in range(3)]
    old, _ = _adapter(tmp_path, cfg, "old", {0: ALL, 1: ALL, 2: ALL}, r=3, seed=10)
    load_adapter_into_slot(pools, 1, old)
    snap = _snapshot(pools)
    # the class read_adapter(dtype=fp16) raises for the same fault: one fault, one error class
    with pytest.raises(NonFiniteWeightError, match=r"adapter 'big': layer 2 o lora_B: overflows the pool's float16"):
        load_adapter_into_slot(pools, 1, big)
    _assert_unchanged(pools, snap)


def test_hand_built_factor_of_wrong_dims_is_a_named_error(tmp_path):
    # Regression: a 1-D factor in a hand-built AdapterWeights raised IndexError from the shape check.
    cfg = _cfg()
    good, _ = _adapter(tmp_path, cfg, "hand", {0: ("q",)}, r=2, seed=11)
    bad = dataclasses.replace(good, layers=({"q": ModuleLoRA(torch.randn(24), torch.randn(20), 1.0)}, {}, {}))
    pools = _pools(cfg)
    snap = _snapshot(pools)
    with pytest.raises(InvalidFieldError, match=r"adapter 'hand' layer 0 q lora_A: expected a tensor of 2 dims"):
        load_adapter_into_slot(pools, 0, bad)
    _assert_unchanged(pools, snap)
