"""Layer shapes and dtypes: what a ``LoRALayerSpec`` is built from (DESIGN.md §5, §7).

Sizes are drawn within the loaded profile's caps; odd sizes (5, 7, 33, ...) are as likely as powers
of two, so kernels' masks are exercised. With ``caps.model_shapes`` (the ``gpu`` / ``soak``
profiles) real layer shapes are among the draws (:data:`MODEL_SHAPES`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch
from hypothesis import strategies as st

from moelora_conformance.profiles import SizeCaps, current_profile
from moelora_conformance.strategies.choice import uniform
from moelora_core.layer_spec import DENSE_MODULES, LoRALayerSpec

#: Real layer shapes by name: H, I, E, top_k and the attention projections (in, out).
MODEL_SHAPES: Mapping[str, dict] = {
    "qwen3-30b-a3b-layer": {
        "hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128, "top_k": 8,
        "dense_shapes": (("q", (2048, 4096)), ("k", (2048, 512)), ("v", (2048, 512)), ("o", (4096, 2048))),
    },
}

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True, kw_only=True)
class LayerShape:
    """The structure of one layer and its adapter pool (no values).

    Attributes:
        hidden_size: H. moe_intermediate_size: I. num_experts: E (experts with LoRA).
        num_base_experts: E_base >= E; ids in [E, E_base) are extra fused experts (shared-expert
            fusion) that have base weights and no LoRA.
        top_k: experts per token.
        dense_shapes: ((module, (in, out)), ...) of the attention projections (may be empty).
        max_loras: adapter slots. max_rank: R.
        name: "drawn" or a key of :data:`MODEL_SHAPES`.
    """

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_base_experts: int
    top_k: int
    dense_shapes: tuple[tuple[str, tuple[int, int]], ...]
    max_loras: int
    max_rank: int
    name: str = field(default="drawn")

    def spec(self, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
             *, virtual_experts: bool = False) -> LoRALayerSpec:
        """The ``LoRALayerSpec`` of this shape."""
        return LoRALayerSpec(
            hidden_size=self.hidden_size, moe_intermediate_size=self.moe_intermediate_size,
            num_experts=self.num_experts, top_k=self.top_k, dense_shapes=dict(self.dense_shapes),
            max_loras=self.max_loras, max_rank=self.max_rank, dtype=dtype, device=torch.device(device),
            virtual_experts=virtual_experts,
        )

    def describe(self) -> str:
        extra = self.num_base_experts - self.num_experts
        dense = ",".join(f"{m}{i}x{o}" for m, (i, o) in self.dense_shapes) or "none"
        return (f"{self.name} H={self.hidden_size} I={self.moe_intermediate_size} E={self.num_experts}"
                f"{f'(+{extra} fused)' if extra else ''} k={self.top_k} L={self.max_loras} R={self.max_rank} "
                f"dense={dense}")


def capped(caps: SizeCaps, limit: SizeCaps) -> SizeCaps:
    """``caps`` with every size bounded by ``limit``'s and no model shapes: for tests whose check
    (e.g. the float64 loop oracle on a CPU) cannot follow the ``gpu`` / ``soak`` sizes. Dtypes are
    those of ``caps``."""
    sizes = {f: min(getattr(caps, f), getattr(limit, f))
             for f in ("max_tokens", "max_requests", "max_hidden", "max_intermediate", "max_experts", "max_top_k",
                       "max_rank", "max_loras")}
    return replace(caps, **sizes, model_shapes=caps.model_shapes and limit.model_shapes,
                   large_offsets=caps.large_offsets and limit.large_offsets)


def _caps(caps: SizeCaps | None) -> SizeCaps:
    return caps if caps is not None else current_profile().caps


@st.composite
def layer_shapes(draw, caps: SizeCaps | None = None, *, min_size: int = 4,
                 extra_experts: bool = True) -> LayerShape:
    """A layer shape within ``caps`` (default: the loaded profile's).

    Args:
        caps: size caps; None = ``current_profile().caps`` at draw time.
        min_size: smallest H, I and dense width.
        extra_experts: also draw ``num_base_experts > num_experts`` (shared-expert fusion).
    """
    caps = _caps(caps)
    max_loras = draw(st.integers(1, caps.max_loras))
    max_rank = draw(st.integers(1, caps.max_rank))
    if caps.model_shapes and draw(st.booleans()):
        name = draw(st.sampled_from(sorted(MODEL_SHAPES)))
        m = MODEL_SHAPES[name]
        return LayerShape(hidden_size=m["hidden_size"], moe_intermediate_size=m["moe_intermediate_size"],
                          num_experts=m["num_experts"], num_base_experts=m["num_experts"], top_k=m["top_k"],
                          dense_shapes=m["dense_shapes"], max_loras=max_loras, max_rank=max_rank, name=name)
    H = draw(st.integers(min_size, caps.max_hidden))
    I = draw(st.integers(min_size, caps.max_intermediate))  # noqa: E741
    E = draw(st.integers(1, caps.max_experts))
    top_k = draw(st.integers(1, min(caps.max_top_k, E)))
    # 0, 1 or 2 extra fused experts, each a third of the draws: ids E and E_base - 1 are boundaries
    # the routing always draws (strategies.routing) where sentinels are drawn
    extra = draw(uniform((0, 1, 2))) if extra_experts else 0
    modules = draw(st.sampled_from(("qkvo", "none", "qo", "kv")))
    d_q = draw(st.integers(min_size, caps.max_hidden))
    d_kv = draw(st.integers(min_size, caps.max_hidden))
    dims = {"q": (H, d_q), "k": (H, d_kv), "v": (H, d_kv), "o": (d_q, H)}
    dense = tuple((m, dims[m]) for m in DENSE_MODULES if m in modules)
    return LayerShape(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_base_experts=E + extra, top_k=top_k,
                      dense_shapes=dense, max_loras=max_loras, max_rank=max_rank)


def dtypes(caps: SizeCaps | None = None) -> st.SearchStrategy[torch.dtype]:
    """A compute dtype the caps allow; bf16 only where CUDA is present (the Triton interpreter
    computes bf16 wrongly on the CPU)."""

    @st.composite
    def _draw(draw):
        allowed = [d for d in _caps(caps).dtypes if d is not torch.bfloat16 or torch.cuda.is_available()]
        return draw(st.sampled_from(allowed))

    return _draw()
