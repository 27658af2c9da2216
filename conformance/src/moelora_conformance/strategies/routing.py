"""Routing: which experts each token goes to, with a controlled share of sentinel expert ids.

Hypothesis draws the *plan* (mode, hot or empty experts, sentinel share, renormalisation, a seed);
``materialize`` draws router logits from a ``torch.Generator`` seeded with it, then softmax (fp32)
→ top-k distinct experts → optional renormalisation → sentinel replacement:

- ``uniform``: logits ~ N(0, 1).
- ``one_expert``: every token's logit for one hot expert is raised just above its largest other
  logit, so every token routes to it first with a non-degenerate weight (top_k > 1: the other
  experts as drawn, with weights that still matter).
- ``some_empty``: a drawn set of experts (leaving at least top_k) gets -inf: no token routes there.
- ``grouped_sigmoid``: DeepSeek-V3 / Kimi-K2 routing (DESIGN.md §1) by the one function that
  computes it, ``moelora_reference.routing.route_grouped_sigmoid``: a drawn
  :class:`~moelora_core.routing.GroupLimitedRouting` (``n_group``, ``topk_group``, a
  ``routed_scaling_factor`` > 1) and a correction bias ~ N(0, 0.5²) [E] drawn after the logits, so
  the experts of a token lie in its kept groups, the bias changes the selection but not the
  weights, and the weights sum to the scaling factor (renormalised) or to a sum of sigmoids — never
  to 1. Where the base has extra fused experts and top_k >= 2, the last column is a fused shared
  expert (below). The ids of the routed columns are in descending biased score, not by weight.

Fused shared expert (SGLang's shared-expert fusion): where the base has extra fused experts and
top_k >= 2 — always in ``grouped_sigmoid`` mode, in three draws in four of the other modes — only
top_k - 1 columns are routed (softmax modes: the top k - 1, renormalised over those), and the last
column holds an id in ``[E, E_base)`` drawn per token, with weight 1: the shared experts take neither
a routing weight nor the scaling factor.

Sentinel replacement: each (token, k) pair is replaced with probability ``sentinel_share`` by -1
(expert parallelism: not handled here) or, where the base declares extra fused experts, by an id in
``[E, E_base)`` (base only, no LoRA). The router weight of a replaced pair is kept.

Boundaries are always drawn: wherever the share is above 0, the first replaced pairs (at least
that many pairs are replaced) hold exactly the boundary ids :meth:`RoutingPlan.boundary_ids` — -1,
E and E_base - 1 — and, unless that expert is empty, one routed pair holds E - 1, the last LoRA
expert. E - 1 goes into a routed column, never the fused shared one; in ``grouped_sigmoid`` mode
that one token may then hold E - 1 outside its kept groups.

A boundary id only tests a bound where a LoRA is read: on a base token (slot -1) every id means "no
LoRA" to a right backend and to a wrong one alike. Given the batch's token slots
(``materialize(token_slots=...)``, as every case and derived batch passes them), "first" is in token
order with the adapter tokens (slot >= 0) before the base ones (E placed first). A token of every
adapter slot of the batch holds E where the base has extra fused experts — with a fused shared
expert, whatever the share, the shared column of the slot's first token — and, where sentinels are
drawn, -1 and E in replaced pairs (a routed pair replaced for one where none is to spare; none where
every pair of the slot's tokens holds another boundary). An upper-bound check off by one (an id of
exactly E reading the next slot's first expert through a flat ``[L·E]`` index: SGLang's
shared-expert-fusion fault, the mutant ``expert-id-E-off-by-one``), or a -1 turned into the previous
slot's last expert (``sentinel-to-other-adapter``), is then seen by every such example whose batch
has a token on that other slot (and an expert LoRA there), not only where a boundary happened to
land on an adapter token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from moelora_conformance.strategies.choice import uniform, weighted
from moelora_core.routing import GroupLimitedRouting
from moelora_core.sentinels import EXPERT_NOT_HERE, NO_ADAPTER
from moelora_reference.routing import route_grouped_sigmoid

ROUTING_MODES = ("uniform", "one_expert", "some_empty", "grouped_sigmoid")
#: How often each mode is drawn: DeepSeek-style routing in a fifth of the draws (where feasible).
_MODE_WEIGHTS = {"uniform": 1.0, "one_expert": 1.0, "some_empty": 1.0, "grouped_sigmoid": 0.75}
#: ``routed_scaling_factor`` values drawn (DeepSeek-V3's 2.5, Kimi-K2's 2.827), all > 1.
SCALING_FACTORS = (2.5, 1.5, 2.827)
_BIAS_STD = 0.5
#: Sentinel shares drawn by default (0 half the time).
SENTINEL_SHARES = (0.0, 0.0, 0.1, 0.3)
_HOT_MARGIN = 0.5


@dataclass(frozen=True)
class RoutingPlan:
    """How one batch is routed.

    Attributes:
        mode: one of :data:`ROUTING_MODES`.
        num_experts: E (LoRA experts). num_base_experts: E_base >= E. top_k: experts per token.
        renormalize: the k weights are divided by their sum (``norm_topk_prob``).
        hot_expert: the ``one_expert`` target, else None.
        empty_experts: experts no token routes to (``some_empty``), else ().
        sentinel_share: probability that a pair is replaced by a sentinel id.
        seed: seeds the generator of ``materialize``.
        grouping: the group-limited router of ``grouped_sigmoid``, else None.
        shared_expert: the last column is a fused shared expert of weight 1 (needs E_base > E and
            top_k >= 2).
    """

    mode: str
    num_experts: int
    num_base_experts: int
    top_k: int
    renormalize: bool
    hot_expert: int | None
    empty_experts: tuple[int, ...]
    sentinel_share: float
    seed: int
    grouping: GroupLimitedRouting | None = None
    shared_expert: bool = False

    @property
    def routed_k(self) -> int:
        """The columns routed to LoRA experts: top_k, less the fused shared expert's column."""
        return self.top_k - int(self.shared_expert)

    def boundary_ids(self) -> tuple[int, ...]:
        """The sentinel ids every draw with sentinels holds: -1, then E and E_base - 1 where the base
        has extra fused experts (one id when there is one such expert)."""
        extra = range(self.num_experts, self.num_base_experts)
        return (-1, *sorted({extra[0], extra[-1]})) if len(extra) else (-1,)

    def describe(self) -> str:
        detail = {"one_expert": f"({self.hot_expert})", "some_empty": f"({list(self.empty_experts)})"}
        if self.grouping is not None:
            g = self.grouping
            detail["grouped_sigmoid"] = f"(G={g.n_group} keep={g.topk_group} scale={g.routed_scaling_factor:g})"
        return (f"routing={self.mode}{detail.get(self.mode, '')}{' +shared' if self.shared_expert else ''} "
                f"sentinels={self.sentinel_share:g}{' renorm' if self.renormalize else ''}")

    def materialize(
        self, num_tokens: int, device: torch.device | str = "cpu", generator: torch.Generator | None = None,
        token_slots: Sequence[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draw the routing of ``num_tokens`` tokens.

        Args:
            num_tokens: T.
            device: where the tensors go (values are drawn by a generator on that device).
            generator: continue an existing generator (a case's) instead of seeding a new one.
            token_slots: the batch's adapter slot of every token (``BatchSpec.token_lora_mapping``;
                -1 = base): the boundary ids go to adapter tokens first, and E to a token of every
                adapter slot (module docstring). None: every token alike. The generator's draws do
                not depend on it.

        Returns:
            (topk_ids [T, k] int32, topk_weights [T, k] fp32, router_logits [T, E] fp32).

        Raises:
            ValueError: ``token_slots`` is not of length T.
        """
        if token_slots is not None and len(token_slots) != num_tokens:
            raise ValueError(f"token_slots has {len(token_slots)} entries for {num_tokens} tokens")
        device = torch.device(device)
        if generator is None:
            generator = torch.Generator(device).manual_seed(self.seed)
        E, k = self.num_experts, self.top_k
        logits = torch.randn(num_tokens, E, generator=generator, device=device, dtype=torch.float32)
        if self.hot_expert is not None and num_tokens:
            logits[:, self.hot_expert] = logits.max(dim=-1).values + _HOT_MARGIN
        if self.empty_experts:
            logits[:, list(self.empty_experts)] = float("-inf")
        if self.grouping is not None:
            bias = torch.randn(E, generator=generator, device=device) * _BIAS_STD
            weights, ids = route_grouped_sigmoid(logits, bias, self.routed_k, self.grouping, self.renormalize)
        else:
            probs = torch.softmax(logits, dim=-1)
            weights, ids = torch.topk(probs, self.routed_k, dim=-1)
            if self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        ids = ids.to(torch.int32)
        if self.shared_expert:
            weights, ids = self._with_shared_column(weights, ids, generator, token_slots)
        # Draw the sentinel coins whatever the share, so the other values do not depend on it.
        coin = torch.rand(num_tokens, k, generator=generator, device=device)
        pick = torch.rand(num_tokens, k, generator=generator, device=device)
        extra = self.num_base_experts - E
        if extra > 0:
            fused = E + (pick * extra).long().clamp(max=extra - 1).to(torch.int32)
            sentinel = torch.where(pick < 0.5, torch.full_like(ids, -1), fused)
        else:
            sentinel = torch.full_like(ids, -1)
        replaced = coin < self.sentinel_share
        if self.sentinel_share > 0 and num_tokens:
            ids, sentinel, replaced = self._with_boundaries(ids, sentinel, replaced, token_slots)
        ids = torch.where(replaced, sentinel, ids)
        return ids, weights.to(torch.float32).contiguous(), logits

    def _with_shared_column(self, weights: torch.Tensor, ids: torch.Tensor, generator: torch.Generator,
                            token_slots: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k], topk_ids [T, k] int32): the routed columns ``weights`` / ``ids``
        [T, k - 1] and the fused shared expert's column (module docstring): weight 1, an id in
        ``[E, E_base)`` drawn from ``generator`` per token, and E on the first token of every adapter
        slot in ``token_slots``."""
        T, device = ids.shape[0], ids.device
        extra = self.num_base_experts - self.num_experts
        u = torch.rand(T, 1, generator=generator, device=device)
        shared = self.num_experts + (u * extra).long().clamp(max=extra - 1)
        firsts = list(_first_tokens(token_slots).values())
        if firsts:
            shared[firsts] = self.num_experts
        return (torch.cat([weights, torch.ones_like(weights[:, :1])], dim=1),
                torch.cat([ids, shared.to(torch.int32)], dim=1))

    def _with_boundaries(self, ids: torch.Tensor, sentinel: torch.Tensor, replaced: torch.Tensor,
                         token_slots: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids, sentinel, replaced) with the boundary ids placed (module docstring): in token order,
        adapter tokens first, the first replaced pairs take :meth:`boundary_ids`, E first (pairs from the
        end of a token group are replaced too where too few were); every adapter slot that holds no
        -1 (no E, where the base has extra fused experts) yet gets it in a replaced pair of its first
        token with a pair not holding a boundary (its last routed pair is replaced for it where it has
        no other); and, where no routed pair holds E - 1 and E - 1 is not empty, the least-weighted free
        routed pair of the first token (same order) that lacks it gets E - 1 (ids of a token stay
        distinct)."""
        T, k = ids.shape
        device = ids.device
        E, bounds = self.num_experts, self.boundary_ids()
        slots = list(token_slots) if token_slots is not None else [NO_ADAPTER] * T
        order = [t for t in range(T) if slots[t] >= 0] + [t for t in range(T) if slots[t] < 0]
        flat = replaced.flatten().cpu().tolist()  # host lists: materialize runs outside graphs
        positions: list[int] = []
        for group in ([t for t in order if slots[t] >= 0], [t for t in order if slots[t] < 0]):
            pairs = [t * k + j for t in group for j in range(k)]
            positions += [p for p in pairs if flat[p]] + [p for p in reversed(pairs) if not flat[p]]
        positions = positions[:len(bounds)]
        s = sentinel.flatten().cpu()
        # E first: where the adapter tokens have one pair to spare, E takes it (-1 means no LoRA anywhere)
        for pos, value in zip(positions, sorted(bounds, key=lambda b: b != E)):
            flat[pos] = True
            s[pos] = value
        host_ids = ids.cpu().clone()
        taken = set(positions)
        held, routed_ids = s.tolist(), host_ids.flatten().tolist()
        value = [held[p] if flat[p] else routed_ids[p] for p in range(T * k)]
        tokens_of: dict[int, list[int]] = {}
        for t in range(T):
            tokens_of.setdefault(slots[t], []).append(t)
        for slot in _first_tokens(token_slots):
            tokens = tokens_of[slot]
            for bound in (E, EXPERT_NOT_HERE) if self.num_base_experts > E else (EXPERT_NOT_HERE,):
                if any(value[t * k + j] == bound for t in tokens for j in range(k)):
                    continue
                for t in tokens:  # the first token with a pair to give: a replaced one, else its last routed
                    spare = [t * k + j for j in range(k) if flat[t * k + j] and t * k + j not in taken]
                    free = [t * k + j for j in range(self.routed_k) if t * k + j not in taken]
                    if spare or free:
                        pos = spare[0] if spare else free[-1]
                        flat[pos], s[pos], value[pos] = True, bound, bound
                        taken.add(pos)
                        break
        replaced = torch.tensor(flat, device=device).reshape(T, k)
        last = E - 1
        routed = host_ids.masked_fill(replaced.cpu(), -2)
        if last not in self.empty_experts and not bool((routed == last).any()):
            for t in order:
                free = [j for j in range(self.routed_k) if not flat[t * k + j]]
                if free and last not in routed[t].tolist():  # the ids it keeps (replaced ones become sentinels)
                    host_ids[t, free[-1]] = last  # the token's last routed pair (the least-weighted, softmax)
                    break
        ids, s = host_ids.to(device), s.to(device)
        return ids, s.reshape(T, k), replaced


def _first_tokens(token_slots: Sequence[int] | None) -> dict[int, int]:
    """Adapter slot → the index of its first token in ``token_slots`` (slots >= 0 only; {} for None)."""
    firsts: dict[int, int] = {}
    for t, slot in enumerate(token_slots or ()):
        if slot >= 0:
            firsts.setdefault(slot, t)
    return firsts


@st.composite
def routing_plans(
    draw,
    num_experts: int,
    top_k: int,
    num_base_experts: int | None = None,
    *,
    modes: tuple[str, ...] = ROUTING_MODES,
    sentinel_shares: tuple[float, ...] = SENTINEL_SHARES,
    seed: int | None = None,
) -> RoutingPlan:
    """A ``RoutingPlan`` for E experts (E_base = ``num_base_experts`` or E) and ``top_k``.

    ``some_empty`` is drawn only where an expert can be empty (E > top_k); ``grouped_sigmoid`` where
    E splits into groups of at least two (E >= 2), with a grouping drawn among those whose kept groups
    hold the routed columns (one group first: the simplest, where shrinking goes; groupings that drop
    groups in three draws in four where one exists, and the mode itself twice as often there). Where
    E_base > E and top_k >= 2 the last column is a fused shared expert: always in ``grouped_sigmoid``
    mode, in three draws in four of the others (none: the simplest).
    """
    E_base = num_experts if num_base_experts is None else num_base_experts
    fusable = E_base > num_experts and top_k >= 2
    groupings = _groupings(num_experts, top_k - int(fusable))
    dropping = [(g, kg) for g, kg in groupings if kg < g]
    feasible = [m for m in modes
                if (m != "some_empty" or num_experts > top_k) and (m != "grouped_sigmoid" or groupings)] or ["uniform"]
    # where a grouping can drop groups (the case group-limited routing exists for), grouped_sigmoid
    # weighs twice as much: many shapes (E prime) allow only one group, and the drops must stay common
    mode = draw(weighted([(m, _MODE_WEIGHTS[m] * (2.0 if m == "grouped_sigmoid" and dropping else 1.0))
                          for m in feasible]))
    hot, empty, grouping = None, (), None
    if mode == "grouped_sigmoid":
        # a grouping that drops groups (topk_group < n_group) in three draws in four where one exists
        keep_all = [gk for gk in groupings if gk not in dropping]
        pool = dropping if dropping and draw(weighted([(False, 1.0), (True, 3.0)])) else keep_all
        n_group, topk_group = draw(uniform(pool))
        grouping = GroupLimitedRouting(n_group, topk_group, draw(st.sampled_from(SCALING_FACTORS)))
        shared = fusable
    else:
        shared = fusable and draw(weighted([(False, 1.0), (True, 3.0)]))
    if mode == "one_expert":
        hot = draw(st.integers(0, num_experts - 1))
    elif mode == "some_empty":
        n_empty = draw(st.integers(1, num_experts - top_k))
        empty = tuple(sorted(draw(st.permutations(range(num_experts)))[:n_empty]))
    share = draw(uniform(sentinel_shares))  # sampled_from would favour the first share (0)
    renormalize = draw(st.booleans())
    if seed is None:
        seed = draw(st.integers(0, 2**31 - 1))
    return RoutingPlan(mode, num_experts, E_base, top_k, renormalize, hot, empty, share, seed, grouping, shared)


def _groupings(num_experts: int, routed_k: int) -> list[tuple[int, int]]:
    """Every (n_group, topk_group) that ``GroupLimitedRouting.check_experts`` accepts for
    ``num_experts`` and ``routed_k`` (none where E < 2 or routed_k < 1), one group first."""
    if routed_k < 1:
        return []
    return [(g, kg) for g in range(1, num_experts // 2 + 1) if num_experts % g == 0
            for kg in range(1, g + 1) if kg * (num_experts // g) >= routed_k]
