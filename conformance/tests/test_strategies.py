"""The strategies: the mix of what they draw, and that materialized cases match their structure.

Covers: over 500 draws, at least 20 % of batches have more than 32 requests and every forward
kind, adapter mode and routing mode occurs in at least 5 %; IDLE batches, sentinel ids and mixed
ranks occur; sizes stay within the profile's caps; materialize is deterministic and consistent
with the drawn structure (ranks, σ, routing modes, sentinels); the grouped sigmoid mode is
DeepSeek-V3's routing (group-limited experts, weights summing to a scaling factor > 1, a fused
shared expert) in a share of the draws; the boundary expert ids -1, E - 1, E and E_base - 1 are in
every draw with sentinels; every ``data.draw`` in the
repository carries a ``label=``; ``$CI`` derandomizes every profile.
"""

import ast
import math
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from moelora_conformance.profiles import PROFILES, current_profile, load_profile, on_ci
from moelora_conformance.strategies import (
    ADAPTER_MODES,
    FORWARD_KINDS,
    ROUTING_MODES,
    MoELoRACase,
    capped,
    moe_lora_cases,
    routing_plans,
)
from moelora_core import NO_ADAPTER, assert_exact

# Materializing runs on the CPU: bound the sizes whatever the profile (the mix test uses the profile's).
CAPS = capped(current_profile().caps, PROFILES["dev"].caps)
ROOT = Path(__file__).resolve().parents[2]


def test_draw_mix_over_500_cases():
    cases: list[MoELoRACase] = []

    @settings(max_examples=500, phases=[Phase.generate], derandomize=True, database=None, deadline=None)
    @given(case=moe_lora_cases())
    def collect(case):
        cases.append(case)

    collect()
    n = len(cases)
    assert n == 500
    share = lambda pred: sum(1 for c in cases if pred(c)) / n
    big = share(lambda c: c.batch.bs > 32)
    assert big >= 0.20, f"only {big:.1%} of batches have more than 32 requests"
    for attr, modes in (("kind", FORWARD_KINDS), ("adapter_mode", ADAPTER_MODES), ("routing_mode", ROUTING_MODES)):
        counts = Counter(getattr(c, attr) for c in cases)
        for mode in modes:
            assert counts[mode] / n >= 0.05, f"{attr}={mode} in {counts[mode] / n:.1%} of draws: {dict(counts)}"
    assert share(lambda c: c.routing.sentinel_share > 0) >= 0.2
    # DeepSeek-style routing that drops groups, and with a fused shared expert
    grouped = lambda c: c.routing.grouping is not None
    assert share(lambda c: grouped(c) and c.routing.grouping.topk_group < c.routing.grouping.n_group) >= 0.02
    assert share(lambda c: grouped(c) and c.routing.shared_expert) >= 0.01
    assert share(lambda c: c.shape.num_base_experts > c.shape.num_experts) >= 0.2
    assert share(lambda c: 0 in c.batch.lora_ranks) >= 0.1  # empty slots
    assert share(lambda c: any(0 < r < c.shape.max_rank for r in c.batch.lora_ranks)) >= 0.3  # r < R
    assert share(lambda c: any(a is not None and a.use_rslora for a in c.pool)) >= 0.3
    assert share(lambda c: 1 in c.batch.seq_lens) >= 0.5  # length-1 requests
    assert share(lambda c: any(r.prefix_len > 0 for r in c.batch.requests) and c.kind == "mixed") >= 0.05
    assert share(lambda c: len({a.adapter_scaling for a in c.pool if a is not None}) > 1) >= 0.1  # σ per slot
    assert {c.dtype for c in cases} == set(current_profile().caps.dtypes) - (
        set() if torch.cuda.is_available() else {torch.bfloat16})
    caps = current_profile().caps
    for c in cases:
        s = c.shape
        assert c.batch.num_tokens <= caps.max_tokens and c.batch.bs <= caps.max_requests
        assert s.hidden_size <= caps.max_hidden and s.moe_intermediate_size <= caps.max_intermediate
        assert s.num_experts <= caps.max_experts and s.top_k <= caps.max_top_k
        assert s.max_rank <= caps.max_rank and s.max_loras <= caps.max_loras


def test_expert_layouts_are_drawn_for_a_backend_that_declares_them():
    # shared_expert_factors=True: pools storing factors once per slot, and shared adapters in every
    # pool they fit (broadcast into per-expert pools); without it, per-expert pools only
    drawn: list[MoELoRACase] = []

    @settings(max_examples=60, phases=[Phase.generate], derandomize=True, database=None, deadline=None)
    @given(case=moe_lora_cases(CAPS, shared_expert_factors=True), plain=moe_lora_cases(CAPS))
    def collect(case, plain):
        assert plain.expert_layout == "per_expert"
        drawn.append(case)

    collect()
    pools = Counter(c.expert_layout for c in drawn)
    assert pools["shared_outer"] and pools["fully_shared"] and pools["per_expert"], pools
    pairs = {(c.expert_layout, a.expert_layout) for c in drawn for a in c.pool if a is not None}
    assert {("per_expert", "shared_outer"), ("shared_outer", "shared_outer"), ("fully_shared", "fully_shared")} <= pairs
    case = next(c for c in drawn if c.expert_layout == "shared_outer")
    m = case.materialize()
    assert m.lora.storage("gate_up_A").shape[2] == 1 and m.lora.gate_up_A.stride(2) == 0
    assert "expert-layout=shared_outer" in case.describe()


@given(case=moe_lora_cases(CAPS))
def test_materialize_matches_the_structure(case):
    m = case.materialize()
    again = case.materialize()
    for name in ("x", "topk_ids", "topk_weights", "router_logits"):
        assert_exact(getattr(again, name), getattr(m, name), what=name, seed=case.seed)
    assert_exact(again.lora.gate_up_A, m.lora.gate_up_A, what="gate_up_A", seed=case.seed)
    spec, batch = m.spec, case.batch
    T = batch.num_tokens
    assert m.x.shape == (T, spec.H) and m.x.dtype == case.dtype
    assert m.topk_ids.shape == (T, spec.top_k) and m.topk_ids.dtype == torch.int32
    assert m.topk_weights.dtype == torch.float32
    assert m.lora.slot_ranks() == batch.lora_ranks
    assert m.lora.slot_scalings() == batch.scalings
    for slot, adapter in enumerate(case.pool):
        for module, rank, _ in (adapter.modules if adapter else ()):
            assert int(m.lora.ranks(module)[slot]) == rank
            assert math.isclose(float(m.lora.scalings(module)[slot]), adapter.scaling(module), rel_tol=1e-6)
    assert m.token_lora_mapping.tolist() == list(batch.token_lora_mapping)
    ids = m.topk_ids
    assert bool(((ids >= -1) & (ids < case.shape.num_base_experts)).all())
    valid = ids[(ids >= 0) & (ids < spec.E)]
    assert valid.numel() == 0 or int(valid.max()) < spec.E
    if case.routing.sentinel_share == 0:  # every routed column holds a LoRA expert, the shared one a fused id
        kr = case.routing.routed_k
        assert bool(((ids[:, :kr] >= 0) & (ids[:, :kr] < spec.E)).all()), case.describe()
        assert bool((ids[:, kr:] >= spec.E).all()), case.describe()
        for row in ids.tolist():
            assert len(set(row)) == len(row), "top-k experts must be distinct"
    if case.routing.renormalize and T:
        # softmax: the k weights sum to 1; grouped sigmoid: the routed ones to the scaling factor
        routing = case.routing
        total = routing.grouping.routed_scaling_factor if routing.grouping else 1.0
        routed = m.topk_weights[:, :routing.routed_k].sum(-1)
        assert torch.allclose(routed, torch.full((T,), total), atol=1e-5), case.describe()
    assert case.describe().startswith(f"seed={case.seed}")


@given(plan=routing_plans(6, 2, 8, sentinel_shares=(0.0,)))
def test_routing_modes_do_what_they_say(plan):
    ids, weights, _ = plan.materialize(40)
    if plan.mode == "one_expert":
        assert bool((ids[:, 0] == plan.hot_expert).all())
        assert float(weights[:, 1].min()) > 1e-3  # the other pair still matters
    if plan.mode == "some_empty":
        assert not set(ids.flatten().tolist()) & set(plan.empty_experts)
    if plan.mode != "grouped_sigmoid" and plan.routed_k == 2:  # the grouped routing's columns are by biased score
        assert bool((weights[:, 0] >= weights[:, 1]).all())
    if plan.shared_expert:  # a fused shared expert's column in any mode: weight 1, an id in [E, E_base)
        assert bool(((ids[:, -1] >= 6) & (ids[:, -1] < 8)).all()) and bool((weights[:, -1] == 1).all())


@settings(max_examples=30, deadline=None)
@given(E=st.sampled_from((4, 6, 8, 12)), extra=st.integers(0, 2), k=st.integers(1, 4), renorm=st.booleans(),
       data=st.data())
def test_grouped_sigmoid_routing_is_deepseek_v3s(E, extra, k, renorm, data):
    # the grouped mode is transformers' DeepseekV3TopkRouter on the drawn logits and bias: experts in
    # the token's best topk_group groups (by the two best biased scores), weights from the unbiased
    # sigmoid (renormalised: they sum to the scaling factor > 1), the fused shared expert's column of
    # weight 1 where the base has extra experts; the routing equation itself is held to transformers
    # in test_deepseek_routing
    k = min(k, E)
    plan = data.draw(routing_plans(E, k, E + extra, modes=("grouped_sigmoid",), sentinel_shares=(0.0,)),
                     label="plan")
    plan = replace(plan, renormalize=renorm)
    assert plan.mode == "grouped_sigmoid" and plan.grouping.routed_scaling_factor > 1
    assert plan.shared_expert == (extra > 0 and k >= 2)
    T = 24
    ids, weights, logits = plan.materialize(T)
    gen = torch.Generator().manual_seed(plan.seed)
    assert torch.equal(logits, torch.randn(T, E, generator=gen))
    bias = torch.randn(E, generator=gen) * 0.5
    g, kr = plan.grouping, plan.routed_k
    p = torch.sigmoid(logits.double())
    q = (p + bias.double()).view(T, g.n_group, E // g.n_group)
    kept = q.topk(2, dim=-1).values.sum(-1).topk(g.topk_group, dim=-1).indices  # [T, topk_group]
    routed = ids[:, :kr].long()
    assert bool((routed // (E // g.n_group)).unsqueeze(-1).eq(kept.unsqueeze(1)).any(-1).all()), "outside kept groups"
    expected = p.gather(1, routed)
    if renorm:
        expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(weights[:, :kr].double(), expected * g.routed_scaling_factor, rtol=1e-6, atol=0)
    if plan.shared_expert:
        assert bool(((ids[:, -1] >= E) & (ids[:, -1] < E + extra)).all()) and bool((weights[:, -1] == 1).all())
    for row in routed.tolist():
        assert len(set(row)) == len(row)


@given(plan=routing_plans(4, 2, 6, sentinel_shares=(0.5,)))
def test_sentinels_take_both_forms_and_keep_the_rest(plan):
    ids, _, _ = plan.materialize(64)
    assert bool((ids == -1).any()) and bool((ids >= 4).any())
    assert bool(((ids >= 0) & (ids < 4)).any())


@given(E=st.integers(1, 8), extra=st.integers(0, 2), k=st.integers(1, 3), T=st.integers(1, 40),
       share=st.sampled_from((0.05, 0.1, 0.3, 1.0)), mode=st.sampled_from(ROUTING_MODES), data=st.data())
def test_boundary_expert_ids_are_in_every_draw_with_sentinels(E, extra, k, T, share, mode, data):
    # -1, E and E_base - 1 in every draw with sentinels, and E - 1 among the routed pairs (where it
    # is not an empty expert and some pair is routed): an upper bound checked as `id >= 0` only, or
    # off by one, is caught by the first such example (a 150-example search found it before)
    k = min(k, E)
    plan = data.draw(routing_plans(E, k, E + extra, modes=(mode,), sentinel_shares=(share,)), label="plan")
    assert plan.boundary_ids() == ((-1, *sorted({E, E + extra - 1})) if extra else (-1,))
    ids, _, _ = plan.materialize(T)
    present = set(ids.flatten().tolist())
    bounds = sorted(plan.boundary_ids(), key=lambda b: b != E)  # placed E first where not all fit
    assert set(bounds[: T * k]) <= present, (bounds, present)
    if bool(((ids >= 0) & (ids < E)).any()) and E - 1 not in plan.empty_experts:
        assert E - 1 in present, present
    for t in range(T):  # a token's routed experts stay distinct
        row = [e for e in ids[t].tolist() if 0 <= e < E]
        assert len(row) == len(set(row)), ids[t]


@settings(max_examples=40, deadline=None)
@given(E=st.integers(1, 8), extra=st.integers(1, 2), k=st.integers(1, 2), L=st.integers(1, 4),
       share=st.sampled_from((0.0, 0.1, 1.0)), mode=st.sampled_from(ROUTING_MODES), data=st.data())
def test_ids_E_and_minus_1_are_on_a_token_of_every_adapter_slot(E, extra, k, L, share, mode, data):
    # given the batch's token slots, the boundary ids go to adapter tokens first, and E and -1 to a token
    # of every adapter slot (E: sentinels drawn, or a fused shared column; -1: sentinels drawn): an
    # off-by-one upper bound that reads the next slot's first expert (expert-id-E-off-by-one), or a -1
    # read as the previous slot's last expert (sentinel-to-other-adapter), is seen wherever the batch has
    # a token on that other slot, not only where a boundary lands on an adapter token
    k = min(k, E)
    slots = data.draw(st.lists(st.integers(-1, L - 1), min_size=1, max_size=30), label="token slots")
    plan = data.draw(routing_plans(E, k, E + extra, modes=(mode,), sentinel_shares=(share,)), label="plan")
    ids, _, _ = plan.materialize(len(slots), token_slots=slots)
    assert torch.equal(plan.materialize(len(slots), token_slots=slots)[0], ids)  # deterministic
    for slot in {s for s in slots if s >= 0}:
        rows = ids[[t for t, s in enumerate(slots) if s == slot]]
        has_pairs = rows.numel() > len(plan.boundary_ids())  # the boundaries may take them all
        if (plan.shared_expert and share == 0) or (share > 0 and has_pairs):
            assert bool((rows == E).any()), (slot, slots, ids.tolist())
        if share > 0 and has_pairs:  # and -1: a sentinel turned into another slot's expert is seen too
            assert bool((rows == -1).any()), (slot, slots, ids.tolist())
    adapter = [t for t, s in enumerate(slots) if s >= 0]
    if share > 0 and len(adapter) * k >= len(plan.boundary_ids()):
        held = set(ids[adapter].flatten().tolist())
        assert set(plan.boundary_ids()) <= held, (plan.boundary_ids(), held)
    if share == 0 and not plan.shared_expert:
        assert bool(((ids >= 0) & (ids < E)).all())  # no sentinels: every column a LoRA expert
    with pytest.raises(ValueError, match="token_slots has"):
        plan.materialize(len(slots) + 1, token_slots=slots)


def test_idle_batches_are_drawable():
    seen = []

    @settings(max_examples=20, phases=[Phase.generate], database=None, deadline=None)
    @given(case=moe_lora_cases(CAPS, kinds=("idle",)))
    def collect(case):
        m = case.materialize()
        assert m.x.shape[0] == 0 and case.batch.bs == 0 and m.token_lora_mapping.numel() == 0
        assert not case.batch.has_active_lora and all(s == NO_ADAPTER for s in case.batch.req_weight_indices)
        seen.append(case)

    collect()
    assert seen


def _draw_calls_without_label(path: Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "draw"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "data"
                and not any(k.arg == "label" for k in node.keywords)):
            yield node.lineno


def test_every_data_draw_has_a_label():
    skip = {".git", ".nox", ".venv", "build", "node_modules"}
    missing = []
    for path in ROOT.rglob("*.py"):
        if skip & set(path.relative_to(ROOT).parts):
            continue
        missing += [f"{path.relative_to(ROOT)}:{line}" for line in _draw_calls_without_label(path)]
    assert not missing, f"data.draw without label= at {missing}"


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("1", True), ("yes", True), ("", False),
                                                 ("0", False), ("false", False), ("No", False), (None, False)])
def test_ci_derandomizes_every_profile(monkeypatch, value, expected):
    before = current_profile().name
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    try:
        assert on_ci() is expected
        load_profile("interpret")
        assert settings.default.derandomize is expected
    finally:
        monkeypatch.undo()
        load_profile(before)
