"""The whole MoE-LoRA layer case: one composite that every backend property draws from.

:func:`moe_lora_cases` draws the structure — a layer shape, a dtype, the adapter pool, a batch, a
routing plan, virtual experts on/off, the dense outputs' layout, the number of MoE layers — and a
seed. :meth:`MoELoRACase.materialize` builds every tensor from that seed with one
``torch.Generator`` on the target device, in a fixed order, so a case replays exactly from its
``describe()`` line. Scales keep activations O(1): base and LoRA A weights ~ N(0, 1/fan_in), LoRA
B ~ N(0, 1/r) (as PEFT's ``init_lora_weights=False``: B is not zero, so every delta is visible).

- **Dense layout** (:data:`DENSE_LAYOUTS`): ``contiguous`` — each dense module writes its own
  ``[T, out]`` tensor; ``fused-qkv`` — the q, k and v outputs present are column slices of one fused
  buffer (``out = qkv[:, a:b]``, a strided view, as engines with a fused qkv projection pass it),
  with guard columns around each slice that no delta may touch.
- **MoE layers**: 1, or 2 where a property asks (one ``prepare``, then two MoE layers, as an engine
  runs every decoder layer on one batch info). Layer 2 has its own base weights, its own pool (the
  same adapters in the same slots — ranks, σ — with other values) and its own routing; its input is
  layer 1's output (RMS-normalized by the harness). Its values come from a second generator, so
  layer 1's are the same either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
from hypothesis import strategies as st

from moelora_conformance.profiles import SizeCaps, current_profile
from moelora_conformance.snapshot import AdapterSnapshot
from moelora_conformance.strategies.adapters import (
    SlotAdapter,
    adapter_pools,
    expert_layouts,
    fits_pool,
    pool_ranks,
    pool_scalings,
)
from moelora_conformance.strategies.batches import BatchPlan, batch_plans
from moelora_conformance.strategies.choice import uniform
from moelora_conformance.strategies.routing import RoutingPlan, routing_plans
from moelora_conformance.strategies.shapes import DTYPE_NAMES, LayerShape, dtypes, layer_shapes
from moelora_core.base_weights import MoEBaseWeights
from moelora_core.batch import BatchSpec
from moelora_core.layer_spec import EXPERT_FACTORS, EXPERT_LAYOUTS, MOE_MODULES, LoRALayerSpec, expert_factor
from moelora_core.moe_activation import SWIGLU_OAI, MoEActivation
from moelora_core.weights import LoRAWeights, ModuleLoRA

#: Layouts of the dense projections' outputs (module docstring).
DENSE_LAYOUTS = ("contiguous", "fused-qkv")
#: The dense modules a ``fused-qkv`` layout fuses (those of the spec).
FUSED_MODULES = ("q", "k", "v")


def adapter_modules(spec: LoRALayerSpec, adapter: SlotAdapter, gen: torch.Generator) -> dict[str, ModuleLoRA]:
    """Fresh factors for ``adapter``'s modules (``load_slot``'s argument), drawn from ``gen`` on the
    spec's device in the spec's dtype: A ~ N(0, 1/fan_in), B ~ N(0, 1/r); σ per module. An expert
    factor the adapter's layout shares is drawn once, ``[1, r, in]`` / ``[1, out, r]``; an adapter
    whose layout does not fit the pool's (one drawn without the pool in view, e.g. a reload) is drawn
    in the pool's layout."""
    layout = adapter.expert_layout if fits_pool(adapter.expert_layout, spec.expert_layout) else spec.expert_layout
    shared = EXPERT_LAYOUTS[layout]
    modules = {}
    for m, r, _ in adapter.modules:
        fin, fout = spec.module_shape(m)
        moe = m in MOE_MODULES
        lead_a = ((1 if expert_factor(m, "A") in shared else spec.E),) if moe else ()
        lead_b = ((1 if expert_factor(m, "B") in shared else spec.E),) if moe else ()
        A = (torch.randn(*lead_a, r, fin, generator=gen, device=spec.device) * (1 / math.sqrt(fin))).to(spec.dtype)
        B = (torch.randn(*lead_b, fout, r, generator=gen, device=spec.device) * (1 / math.sqrt(r))).to(spec.dtype)
        modules[m] = ModuleLoRA(A, B, adapter.scaling(m))
    return modules


def load_pool(lora: LoRAWeights, pool: tuple[SlotAdapter | None, ...], gen: torch.Generator,
              snapshot: AdapterSnapshot | None = None, layer: int = 0) -> None:
    """Load every adapter of ``pool`` into its slot of ``lora`` with fresh values from ``gen``, and
    record what was drawn in ``snapshot`` (layer ``layer``) before the pool sees it."""
    for slot, adapter in enumerate(pool):
        if adapter is not None:
            modules = adapter_modules(lora.spec, adapter, gen)
            if snapshot is not None:
                snapshot.record(layer, slot, modules, adapter.adapter_scaling)
            lora.load_slot(slot, modules, adapter_scaling=adapter.adapter_scaling)


@dataclass
class MoELayer:
    """One more MoE layer of a case (layer 2, ...): its own weights and pool.

    Attributes:
        base: its base weights (the spec's shapes). lora: its pool (the case's adapters, other values).
    """

    base: MoEBaseWeights
    lora: LoRAWeights

    def to(self, device: torch.device | str) -> MoELayer:
        return MoELayer(_base_to(self.base, device), _pool_to(self.lora, device))


def _base_to(base: MoEBaseWeights, device: torch.device | str) -> MoEBaseWeights:
    def to(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return replace(base, w_gate_up=base.w_gate_up.to(device), w_down=base.w_down.to(device), router=to(base.router),
                   b_gate_up=to(base.b_gate_up), b_down=to(base.b_down), router_bias=to(base.router_bias),
                   w_gate_up_scale_inv=to(base.w_gate_up_scale_inv), w_down_scale_inv=to(base.w_down_scale_inv))


def quantize_base_fp8(base: MoEBaseWeights, block: tuple[int, int]) -> MoEBaseWeights:
    """``base`` with its experts quantized to fp8 block-scaled (DESIGN.md §1, "Quantized base"): gate and
    up each on their own scale grid, as a checkpoint stores them. SwiGLU blocks without biases only."""
    from moelora_core.fp8_block import quantize_weight_fp8_block

    inter = base.intermediate_size
    qg, sg = quantize_weight_fp8_block(base.w_gate_up[:, :inter], block)
    qu, su = quantize_weight_fp8_block(base.w_gate_up[:, inter:], block)
    qd, sd = quantize_weight_fp8_block(base.w_down, block)
    return replace(base, w_gate_up=torch.cat([qg, qu], 1), w_down=qd, weight_block=tuple(block),
                   w_gate_up_scale_inv=torch.cat([sg, su], 1), w_down_scale_inv=sd)


def quantized_case(m: MaterializedCase, block: tuple[int, int]) -> MaterializedCase:
    """``m`` with every MoE layer's experts fp8 block-scaled and its spec's ``base_quant`` "fp8_block"
    (the adapters, inputs and routing unchanged)."""
    return replace(m, spec=replace(m.spec, base_quant="fp8_block"), base=quantize_base_fp8(m.base, block),
                   layers=[MoELayer(quantize_base_fp8(ly.base, block), ly.lora) for ly in m.layers])


#: MoE blocks a case draws: the SwiGLU of DESIGN.md §1, or GPT-OSS's (expert biases, swiglu_oai).
BLOCKS: tuple[str, ...] = ("swiglu", "gpt_oss")


def _gpt_oss_block(base: MoEBaseWeights, seed: int, device: torch.device, dtype: torch.dtype) -> MoEBaseWeights:
    """``base`` with GPT-OSS's expert biases (N(0, 0.5²), the size of W x) and its clamped activation, from
    a generator of their own (the other tensors of the case stay what they were). The clamp bound is
    GPT-OSS's 7.0 for odd seeds and 0.75 for even ones, where it binds for many gate and up values."""
    g = torch.Generator(device).manual_seed((seed * 7_000_003 + 17) % 2**63)
    e_base, two_i, h = base.w_gate_up.shape
    b_gate_up = (torch.randn(e_base, two_i, generator=g, device=device) * 0.5).to(dtype)
    b_down = (torch.randn(e_base, h, generator=g, device=device) * 0.5).to(dtype)
    act = MoEActivation("swiglu_oai", alpha=SWIGLU_OAI.alpha, limit=SWIGLU_OAI.limit if seed % 2 else 0.75)
    return replace(base, b_gate_up=b_gate_up, b_down=b_down, activation=act)


def _pool_to(src: LoRAWeights, device: torch.device | str) -> LoRAWeights:
    """A copy of pool ``src`` on ``device`` (tensors and host copies)."""
    lora = LoRAWeights(replace(src.spec, device=torch.device(device)))
    for name in EXPERT_FACTORS:
        lora.storage(name).copy_(src.storage(name))
    for name in ("module_ranks", "module_scalings"):
        getattr(lora, name).copy_(getattr(src, name))
    for name in ("dense_A", "dense_B"):
        for m, t in getattr(src, name).items():
            getattr(lora, name)[m].copy_(t)
    lora.host_ranks = {m: list(v) for m, v in src.host_ranks.items()}
    lora.host_scalings = {m: list(v) for m, v in src.host_scalings.items()}
    lora.host_adapter_scalings = list(src.host_adapter_scalings)
    return lora


@dataclass(kw_only=True)
class MaterializedCase:
    """The tensors of a case on one device.

    Attributes:
        spec: the ``LoRALayerSpec`` (dtype, device, virtual experts as drawn).
        x: [T, H] activations (spec dtype).
        router_logits: [T, E] fp32 logits the routing was drawn from.
        topk_ids: [T, k] int32 (sentinels included). topk_weights: [T, k] fp32.
        base: ``MoEBaseWeights`` (w_gate_up [E_base, 2I, H], w_down [E_base, H, I], spec dtype;
            ``router`` None: routing is given by ``topk_ids``).
        dense_weights: module → [out, in] base weight. dense_x: module → [T, in] its input.
        lora: the pool, slots loaded with ``load_slot``.
        token_lora_mapping: [T] int32 from the batch's host lists.
        layers: the MoE layers after the first (``MoELoRACase.moe_layers - 1`` of them).
        extra_routing: per extra layer, the case batch's (topk_ids [T, k] int32, topk_weights [T, k] fp32).
        snapshot: what the suite loaded into every layer's pool, kept apart from the pools (the
            oracle's source; ``harness.snapshot``).
    """

    spec: LoRALayerSpec
    x: torch.Tensor
    router_logits: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    base: MoEBaseWeights
    dense_weights: dict[str, torch.Tensor]
    dense_x: dict[str, torch.Tensor]
    lora: LoRAWeights
    token_lora_mapping: torch.Tensor
    layers: list[MoELayer] = field(default_factory=list)
    extra_routing: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    snapshot: AdapterSnapshot | None = None

    @property
    def pools(self) -> list[LoRAWeights]:
        """Every MoE layer's pool, layer 1 first (the dense modules live in layer 1's)."""
        return [self.lora, *(layer.lora for layer in self.layers)]

    def to(self, device: torch.device | str) -> MaterializedCase:
        """The same values on ``device`` (e.g. a CPU copy for the float64 oracle of a CUDA run)."""
        device = torch.device(device)
        spec = replace(self.spec, device=device)
        return MaterializedCase(spec=spec, x=self.x.to(device), router_logits=self.router_logits.to(device),
                                topk_ids=self.topk_ids.to(device), topk_weights=self.topk_weights.to(device),
                                base=_base_to(self.base, device),
                                dense_weights={m: t.to(device) for m, t in self.dense_weights.items()},
                                dense_x={m: t.to(device) for m, t in self.dense_x.items()},
                                lora=_pool_to(self.lora, device), token_lora_mapping=self.token_lora_mapping.to(device),
                                layers=[layer.to(device) for layer in self.layers],
                                extra_routing=[(i.to(device), w.to(device)) for i, w in self.extra_routing],
                                snapshot=self.snapshot)


@dataclass(frozen=True)
class MoELoRACase:
    """A self-describing case: structure plus the seed its values come from."""

    shape: LayerShape
    dtype: torch.dtype
    virtual_experts: bool
    pool: tuple[SlotAdapter | None, ...]
    plan: BatchPlan
    routing: RoutingPlan
    seed: int
    dense_layout: str = "contiguous"
    moe_layers: int = 1
    expert_layout: str = "per_expert"
    block: str = "swiglu"

    @property
    def batch(self) -> BatchSpec:
        return self.plan.batch

    @property
    def kind(self) -> str:
        return self.plan.kind

    @property
    def adapter_mode(self) -> str:
        return self.plan.adapter_mode

    @property
    def routing_mode(self) -> str:
        return self.routing.mode

    def spec(self, device: torch.device | str = "cpu") -> LoRALayerSpec:
        return replace(self.shape.spec(self.dtype, device, virtual_experts=self.virtual_experts),
                       expert_layout=self.expert_layout)

    def describe(self) -> str:
        """One line that names everything needed to rebuild the case."""
        pool = " ".join(f"{s}:{'empty' if a is None else a.describe()}" for s, a in enumerate(self.pool))
        extra = f" dense-out={self.dense_layout}" if self.dense_layout != "contiguous" else ""
        extra += f" moe-layers={self.moe_layers}" if self.moe_layers != 1 else ""
        extra += f" expert-layout={self.expert_layout}" if self.expert_layout != "per_expert" else ""
        extra += f" block={self.block}" if self.block != "swiglu" else ""
        return (f"seed={self.seed} {DTYPE_NAMES[self.dtype]} virtual={self.virtual_experts}{extra} "
                f"{self.shape.describe()} | {self.plan.describe()} | {self.routing.describe()} | pool {pool}")

    def materialize(self, device: torch.device | str = "cpu") -> MaterializedCase:
        """Build every tensor from ``seed`` on ``device`` (values differ between device types, and
        are reproducible on each)."""
        device = torch.device(device)
        gen = torch.Generator(device).manual_seed(self.seed)
        spec = self.spec(device)
        dt = self.dtype
        T, H, I, E = self.batch.num_tokens, spec.H, spec.I, spec.E  # noqa: E741
        E_base = self.shape.num_base_experts

        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(dt)

        x = randn(T, H)
        topk_ids, topk_weights, logits = self.routing.materialize(T, device, gen, self.batch.token_lora_mapping)
        base = MoEBaseWeights(
            w_gate_up=randn(E_base, 2 * I, H, scale=1 / math.sqrt(H)),
            w_down=randn(E_base, H, I, scale=1 / math.sqrt(I)),
            router=None, num_experts=E, norm_topk_prob=self.routing.renormalize,
        )
        dense_weights, dense_x = {}, {}
        for m, (fin, fout) in self.shape.dense_shapes:
            dense_weights[m] = randn(fout, fin, scale=1 / math.sqrt(fin))
            dense_x[m] = randn(T, fin)
        lora = LoRAWeights(spec)
        snapshot = AdapterSnapshot([spec] * self.moe_layers)
        load_pool(lora, self.pool, gen, snapshot, 0)
        mapping = torch.tensor(self.batch.token_lora_mapping, dtype=torch.int32, device=device)
        layers, extra_routing = [], []
        for n in range(1, self.moe_layers):
            # A generator of its own: layer 1's values do not depend on the layer count.
            g = torch.Generator(device).manual_seed((self.seed * 1_000_003 + n) % 2**63)
            layer_base = MoEBaseWeights(
                w_gate_up=(torch.randn(E_base, 2 * I, H, generator=g, device=device) * (1 / math.sqrt(H))).to(dt),
                w_down=(torch.randn(E_base, H, I, generator=g, device=device) * (1 / math.sqrt(I))).to(dt),
                router=None, num_experts=E, norm_topk_prob=self.routing.renormalize,
            )
            layer_lora = LoRAWeights(spec)
            load_pool(layer_lora, self.pool, g, snapshot, n)
            ids, w, _ = self.routing.materialize(T, device, g, self.batch.token_lora_mapping)
            layers.append(MoELayer(layer_base, layer_lora))
            extra_routing.append((ids, w))
        if self.block == "gpt_oss":  # drawn last: the other tensors are those of the SwiGLU case
            base = _gpt_oss_block(base, self.seed, device, dt)
            layers = [MoELayer(_gpt_oss_block(ly.base, self.seed + n + 1, device, dt), ly.lora)
                      for n, ly in enumerate(layers)]
        return MaterializedCase(spec=spec, x=x, router_logits=logits, topk_ids=topk_ids, topk_weights=topk_weights,
                                base=base, dense_weights=dense_weights, dense_x=dense_x, lora=lora,
                                token_lora_mapping=mapping, layers=layers, extra_routing=extra_routing,
                                snapshot=snapshot)


@st.composite
def moe_lora_cases(
    draw,
    caps: SizeCaps | None = None,
    *,
    kinds: tuple[str, ...] | None = None,
    adapter_modes: tuple[str, ...] | None = None,
    routing_modes: tuple[str, ...] | None = None,
    virtual_experts: bool | None = None,
    dtype: torch.dtype | None = None,
    moe_layers: tuple[int, ...] = (1,),
    extra_experts: bool = True,
    shared_expert_factors: bool = False,
    blocks: tuple[str, ...] = BLOCKS,
) -> MoELoRACase:
    """A ``MoELoRACase`` within ``caps`` (default: the loaded profile's).

    Args:
        kinds, adapter_modes, routing_modes: restrict the modes drawn (default: all).
        virtual_experts: force virtual experts on/off (default: drawn).
        dtype: force a dtype (default: drawn from the caps; bf16 only with CUDA).
        moe_layers: MoE layer counts to draw from (default: one layer).
        extra_experts: also draw extra fused base experts (ids in ``[E, E_base)``; False for a backend
            that does not declare ``fused_shared_experts``).
        shared_expert_factors: also draw pools that store expert factors once per slot
            ("shared_outer", "fully_shared"; for a backend declaring ``shared_expert_factors``). Either
            way adapters may share factors (drawn to fit the pool: broadcast into a per-expert pool).
        blocks: MoE blocks to draw from (:data:`BLOCKS`: SwiGLU, GPT-OSS's with expert biases and
            swiglu_oai; drawn last, so the other draws are those of a SwiGLU-only search).
    """
    caps = caps if caps is not None else current_profile().caps
    shape = draw(layer_shapes(caps, extra_experts=extra_experts))
    dt = dtype if dtype is not None else draw(dtypes(caps))
    ve = virtual_experts if virtual_experts is not None else draw(st.booleans())
    pool = draw(adapter_pools(shape))
    plan_kw = {k: v for k, v in (("kinds", kinds), ("adapter_modes", adapter_modes)) if v is not None}
    plan = draw(batch_plans(shape.max_loras, pool_ranks(pool), pool_scalings(pool), caps, **plan_kw))
    seed = draw(st.integers(0, 2**31 - 1))
    route_kw = {"modes": routing_modes} if routing_modes is not None else {}
    routing = draw(routing_plans(shape.num_experts, shape.top_k, shape.num_base_experts, seed=seed, **route_kw))
    layout = draw(uniform(DENSE_LAYOUTS))
    layers = draw(uniform(moe_layers)) if len(moe_layers) > 1 else moe_layers[0]
    pool_layout, pool = draw(expert_layouts(pool, shared_pools=shared_expert_factors))
    block = draw(uniform(blocks)) if len(blocks) > 1 else blocks[0]
    return MoELoRACase(shape, dt, ve, pool, plan, routing, seed, layout, layers, pool_layout, block)
