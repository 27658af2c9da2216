"""The adapter pool's structure: per slot, empty or an adapter with its ranks and σ (DESIGN.md §1, §3).

An adapter is drawn as a PEFT config would describe it: rank r, α, rsLoRA, which modules it targets,
and optional per-module rank / α overrides (``rank_pattern`` / ``alpha_pattern``). σ per module is
α_m / r_m (or α_m / √r_m with rsLoRA); the adapter-level σ (what ``BatchSpec.scalings`` holds) uses
the config's r and α. Values (A, B) are drawn later from the case's seed.

α is drawn through a target σ: a scale in {1, 0.5, 2} times a ratio in :data:`SIGMA_RATIOS` (1 in
one draw of six), so every combination keeps fp16 activations far from overflow, σ differs between
slots and modules, and σ is usually *not* a short binary fraction: α/r = 4/3, 6/5, 5/7... and α/√r
are not exactly representable in bf16 or fp16, so a backend that rounds σ through the activation
dtype is visible in an fp32 run (σ stays an fp32 number, as ``LoRAWeights`` stores it).

Expert layouts (``moelora_core.EXPERT_LAYOUTS``): an adapter may share expert factors by every
expert (shared-outer: gate_up A and down B; fully shared: all four), drawn once as ``[1, r, in]``.
:func:`adapter_layouts` draws them to fit the pool's layout: a per-expert pool takes any adapter (a
shared factor is broadcast), a shared-outer pool shared-outer and fully shared ones, a fully shared
pool fully shared ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import strategies as st

from moelora_conformance.strategies.choice import uniform, weighted
from moelora_conformance.strategies.shapes import LayerShape
from moelora_core.adapter_config import lora_scaling
from moelora_core.layer_spec import ALL_MODULES, EXPERT_LAYOUTS, MOE_MODULES

#: Which modules an adapter targets.
MODULE_LAYOUTS = ("all", "moe_only", "dense_only", "subset")
#: σ scales and ratios: target σ = scale · ratio. Ratios other than 1 give a σ that no binary float
#: holds exactly (rounding it through bf16 / fp16 changes it by up to 2⁻⁹ / 2⁻¹²).
SIGMA_SCALES = (1.0, 0.5, 2.0)
SIGMA_RATIOS = (1.0, 4 / 3, 2 / 3, 6 / 5, 5 / 7, 9 / 7)


@dataclass(frozen=True)
class SlotAdapter:
    """One slot's adapter structure.

    Attributes:
        rank: the config's r. alpha: the config's α. use_rslora: σ = α / √r.
        modules: ((module, rank, alpha), ...) for each targeted module, rank <= R (pattern applied).
        expert_layout: which expert factors are one tensor for every expert (``EXPERT_LAYOUTS``).
    """

    rank: int
    alpha: float
    use_rslora: bool
    modules: tuple[tuple[str, int, float], ...]
    expert_layout: str = "per_expert"

    @property
    def slot_rank(self) -> int:
        """What a scheduler sees (``LoRAWeights.slot_rank``): the largest module rank."""
        return max(r for _, r, _ in self.modules)

    @property
    def adapter_scaling(self) -> float:
        """The adapter-level σ (config r and α)."""
        return lora_scaling(self.rank, self.alpha, self.use_rslora)

    def scaling(self, module: str) -> float:
        """σ of ``module`` with its own rank and α."""
        for m, r, a in self.modules:
            if m == module:
                return lora_scaling(r, a, self.use_rslora)
        raise KeyError(module)

    def describe(self) -> str:
        """``r{r}/a{α}[/rs][/layout][module:r{rank}/σ{σ}, ...]``: each module's own rank and σ (a
        σ-handling fault shows in the case line)."""
        mods = ",".join(f"{m}:r{r}/σ{lora_scaling(r, a, self.use_rslora):.5g}" for m, r, a in self.modules)
        layout = "" if self.expert_layout == "per_expert" else f"/{self.expert_layout}"
        return f"r{self.rank}/a{self.alpha:g}{'/rs' if self.use_rslora else ''}{layout}[{mods}]"


#: Pool layout → (adapter layout, weight) drawn for its slots: those whose shared factors cover
#: the pool's (``fits_pool``).
ADAPTER_LAYOUT_WEIGHTS: dict[str, tuple[tuple[str, int], ...]] = {
    "per_expert": (("per_expert", 4), ("shared_outer", 1), ("fully_shared", 1)),
    "shared_outer": (("shared_outer", 3), ("fully_shared", 1)),
    "fully_shared": (("fully_shared", 1),),
}


def fits_pool(adapter_layout: str, pool_layout: str) -> bool:
    """Whether an adapter in ``adapter_layout`` loads into a pool in ``pool_layout`` (it shares every
    factor the pool stores once per slot)."""
    return EXPERT_LAYOUTS[pool_layout] <= EXPERT_LAYOUTS[adapter_layout]


def _alpha_for(sigma: float, rank: int, use_rslora: bool) -> float:
    return sigma * (math.sqrt(rank) if use_rslora else rank)


@st.composite
def sigmas(draw, *, exclude: float | None = None) -> float:
    """A target σ (module docstring): a scale times a ratio, never (within 1e-6) ``exclude``."""
    scale = draw(uniform(SIGMA_SCALES))
    i = draw(uniform(range(len(SIGMA_RATIOS))))
    if exclude is not None and math.isclose(scale * SIGMA_RATIOS[i], exclude, rel_tol=1e-6):
        i = (i + 1) % len(SIGMA_RATIOS)  # the next ratio: another σ at the same scale
    return scale * SIGMA_RATIOS[i]


@st.composite
def slot_adapters(draw, shape: LayerShape, *, ranks: st.SearchStrategy[int] | None = None,
                  exclude_sigma: float | None = None) -> SlotAdapter:
    """One adapter for a pool of ``shape`` (ranks in [1, R], some modules possibly absent).

    Args:
        ranks: the config rank r (default: drawn in [1, R]).
        exclude_sigma: an adapter-level σ the new adapter must not have (a reload's "another σ").
    """
    R = shape.max_rank
    rank = draw(ranks if ranks is not None else st.integers(1, R))
    use_rslora = draw(st.booleans())
    sigma = draw(sigmas(exclude=exclude_sigma))
    alpha = _alpha_for(sigma, rank, use_rslora)
    dense = [m for m, _ in shape.dense_shapes]
    layout = draw(st.sampled_from(MODULE_LAYOUTS))
    if layout == "moe_only" or (layout == "dense_only" and not dense):
        targets = list(MOE_MODULES)
    elif layout == "dense_only":
        targets = dense
    elif layout == "subset":
        available = [*MOE_MODULES, *dense]
        targets = draw(st.lists(st.sampled_from(available), min_size=1, unique=True))
    else:
        targets = [*MOE_MODULES, *dense]
    patterned = draw(st.booleans())  # rank_pattern / alpha_pattern overrides per module
    modules = []
    for m in ALL_MODULES:
        if m not in targets:
            continue
        r_m, a_m = rank, alpha
        if patterned and draw(st.booleans()):
            r_m = draw(st.integers(1, R))
            a_m = _alpha_for(draw(sigmas()), r_m, use_rslora)
        modules.append((m, r_m, a_m))
    return SlotAdapter(rank, alpha, use_rslora, tuple(modules))


@st.composite
def adapter_pools(draw, shape: LayerShape) -> tuple[SlotAdapter | None, ...]:
    """Per slot an adapter or None (an empty, rank-0 slot). At least one slot holds an adapter;
    with two or more slots, some may be empty."""
    L = shape.max_loras
    empty: set[int] = set()
    if L >= 2:
        keep = draw(st.integers(0, L - 1))
        empty = {s for s in range(L) if s != keep and draw(st.integers(0, 3)) == 0}
    return tuple(None if s in empty else draw(slot_adapters(shape)) for s in range(L))


@st.composite
def expert_layouts(draw, pool: tuple[SlotAdapter | None, ...], *, shared_pools: bool
                   ) -> tuple[str, tuple[SlotAdapter | None, ...]]:
    """(the pool's expert layout, ``pool`` with each adapter's layout drawn among those that fit it,
    :data:`ADAPTER_LAYOUT_WEIGHTS`). The pool's layout is "per_expert" unless ``shared_pools`` (a
    backend declaring ``shared_expert_factors``). Drawn after the rest of a case, so the draws before
    it (and the examples a derandomized run makes of them) are those of a run without layouts."""
    layout = draw(weighted([("per_expert", 2), ("shared_outer", 1), ("fully_shared", 1)])) if shared_pools \
        else "per_expert"
    out = []
    for adapter in pool:
        if adapter is not None:
            own = draw(weighted(ADAPTER_LAYOUT_WEIGHTS[layout]))
            adapter = SlotAdapter(adapter.rank, adapter.alpha, adapter.use_rslora, adapter.modules, own)
        out.append(adapter)
    return layout, tuple(out)


def pool_ranks(pool: tuple[SlotAdapter | None, ...]) -> tuple[int, ...]:
    """``BatchSpec.lora_ranks`` of a pool (0 for empty slots)."""
    return tuple(0 if a is None else a.slot_rank for a in pool)


def pool_scalings(pool: tuple[SlotAdapter | None, ...]) -> tuple[float, ...]:
    """``BatchSpec.scalings`` of a pool (0 for empty slots)."""
    return tuple(0.0 if a is None else a.adapter_scaling for a in pool)
