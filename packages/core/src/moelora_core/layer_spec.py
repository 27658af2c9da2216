"""The shape of one LoRA-served layer, as a backend factory receives it (DESIGN.md §5)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from moelora_core.errors import InvalidFieldError
from moelora_core.fp8_block import check_base_quant

#: MoE modules with LoRA: gate and up (applied before the activation) and down (router-weighted).
MOE_MODULES: tuple[str, ...] = ("gate", "up", "down")
#: Dense (attention) projections with LoRA.
DENSE_MODULES: tuple[str, ...] = ("q", "k", "v", "o")
#: The shared expert's projections (Qwen2-MoE ``mlp.shared_expert.{gate,up,down}_proj``): dense
#: modules like the attention projections (one weight for every token, LoRA through
#: ``Backend.dense_delta``), present in a spec only for a model that has a shared expert (DESIGN.md §1).
SHARED_EXPERT_MODULES: tuple[str, ...] = ("shared_gate", "shared_up", "shared_down")
#: DeepSeek-V3's MLA projections beside "q" (``q_proj`` when ``q_lora_rank`` is null) and "o":
#: ``q_a_proj`` / ``q_b_proj`` (the query's low-rank pair) and ``kv_a_proj_with_mqa`` / ``kv_b_proj``
#: (DESIGN.md §1). Dense modules: LoRA through ``Backend.dense_delta``.
MLA_MODULES: tuple[str, ...] = ("q_a", "q_b", "kv_a", "kv_b")
#: The dense SwiGLU MLP of DeepSeek-V3's first ``first_k_dense_replace`` layers (``mlp.gate_proj`` /
#: ``up_proj`` / ``down_proj`` of a layer without experts).
DENSE_MLP_MODULES: tuple[str, ...] = ("dense_gate", "dense_up", "dense_down")
#: Every dense module a spec's ``dense_shapes`` may hold.
DENSE_LORA_MODULES: tuple[str, ...] = DENSE_MODULES + SHARED_EXPERT_MODULES + MLA_MODULES + DENSE_MLP_MODULES
#: Every module a ``LoRAWeights`` can hold, in the order of its per-module rank/σ tables (new
#: modules go last: kernels address the MoE rows by index).
ALL_MODULES: tuple[str, ...] = MOE_MODULES + DENSE_LORA_MODULES
#: The four expert factor buffers of a pool, as ``LoRAWeights`` names them.
EXPERT_FACTORS: tuple[str, ...] = ("gate_up_A", "gate_up_B", "down_A", "down_B")
#: Expert layouts a pool may store (``LoRALayerSpec.expert_layout``) → the factors it keeps once per
#: slot (expert dim 1, read with expert stride 0) instead of once per expert:
#: ``shared_outer`` is SGLang's ``--experts-shared-outer-loras`` contract (gate_up A hidden → rank and
#: down B rank → hidden shared by all experts); ``fully_shared`` Megatron-Bridge's
#: ``collapse_shared_experts`` export (every factor ``[1, ...]``). conformance/docs/checkpoints.md.
EXPERT_LAYOUTS: Mapping[str, frozenset[str]] = MappingProxyType({
    "per_expert": frozenset(),
    "shared_outer": frozenset({"gate_up_A", "down_B"}),
    "fully_shared": frozenset(EXPERT_FACTORS),
})


def expert_factor(module: str, factor: str) -> str:
    """The pool buffer (``EXPERT_FACTORS``) holding ``factor`` ("A"/"B") of MoE ``module``."""
    return f"{'down' if module == 'down' else 'gate_up'}_{factor}"


#: Dtypes a spec may ask for.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidFieldError(name, f"must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class LoRALayerSpec:
    """Shapes and pool sizes of one decoder layer served with LoRA.

    Attributes:
        hidden_size: H, model width (input of gate/up, output of down).
        moe_intermediate_size: I, width of one expert's gate/up output.
        num_experts: E, routed experts of the layer (ids >= E are extra fused experts with no LoRA).
        top_k: experts per token.
        dense_shapes: module ("q", "k", "v", "o"; "shared_gate", "shared_up", "shared_down" for a
            model with a shared expert) → (in_features, out_features).
        max_loras: adapter slots of the pool.
        max_rank: R, the pool's rank; smaller ranks are zero-padded to R.
        dtype: compute and storage dtype of activations and LoRA weights.
        device: where buffers live.
        virtual_experts: ask the backend to compute MoE deltas through virtual experts
            ((slot, expert) as expert ``slot * E + expert`` of a ``max_loras * E``-expert MoE).
            Only meaningful for backends whose capabilities declare ``virtual_experts``.
        expert_layout: a key of ``EXPERT_LAYOUTS``: which expert factors the pool stores once per
            slot (``[L, 1, ...]``, every expert reading them with expert stride 0) rather than per
            expert. Anything but "per_expert" needs a backend declaring ``shared_expert_factors``.
        base_quant: how the base weights the backend's layer runs on are stored
            (``moelora_core.fp8_block.BASE_QUANTS``): "none", or "fp8_block" (fp8 e4m3 block-scaled
            weights, w8a8; DESIGN.md §1). The LoRA pool stays in ``dtype`` either way. Anything but
            "none" needs a backend declaring it in ``Capabilities.base_quants``
            (``moelora_core.backend.check_base_quant_served``).

    Raises:
        InvalidFieldError: a non-positive size, ``top_k > num_experts``, an unknown
            ``expert_layout`` or ``base_quant``, ``dense_shapes`` not a mapping or an unknown dense module, an
            unsupported dtype, an unparsable device.
    """

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    dense_shapes: Mapping[str, tuple[int, int]]
    max_loras: int
    max_rank: int
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    virtual_experts: bool = False
    expert_layout: str = "per_expert"
    base_quant: str = "none"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "moe_intermediate_size", "num_experts", "top_k", "max_loras", "max_rank"):
            _positive(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise InvalidFieldError("top_k", f"must be <= num_experts={self.num_experts}, got {self.top_k}")
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise InvalidFieldError("expert_layout",
                                    f"must be one of {tuple(EXPERT_LAYOUTS)}, got {self.expert_layout!r}")
        check_base_quant(self.base_quant)
        if not isinstance(self.dense_shapes, Mapping):
            raise InvalidFieldError("dense_shapes", f"must be a mapping module -> (in, out), got {self.dense_shapes!r}")
        shapes = {}
        for module, shape in dict(self.dense_shapes).items():
            if module not in DENSE_LORA_MODULES:
                raise InvalidFieldError(
                    f"dense_shapes[{module!r}]", f"unknown dense module; expected one of {DENSE_LORA_MODULES}"
                )
            if len(shape) != 2:
                raise InvalidFieldError(
                    f"dense_shapes[{module!r}]", f"must be (in_features, out_features), got {shape!r}"
                )
            shapes[module] = (_positive(f"dense_shapes[{module!r}][0]", shape[0]),
                              _positive(f"dense_shapes[{module!r}][1]", shape[1]))
        object.__setattr__(self, "dense_shapes", MappingProxyType(shapes))
        if self.dtype not in SUPPORTED_DTYPES:
            raise InvalidFieldError("dtype", f"must be one of {SUPPORTED_DTYPES}, got {self.dtype}")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise InvalidFieldError("device", f"not a torch device: {self.device!r} ({exc})") from None
        object.__setattr__(self, "device", device)

    @property
    def H(self) -> int:
        return self.hidden_size

    @property
    def I(self) -> int:  # noqa: E743
        return self.moe_intermediate_size

    @property
    def E(self) -> int:
        return self.num_experts

    @property
    def R(self) -> int:
        return self.max_rank

    @property
    def shared_factors(self) -> frozenset[str]:
        """The expert factors (``EXPERT_FACTORS``) this spec's pool stores once per slot."""
        return EXPERT_LAYOUTS[self.expert_layout]

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of ``module`` for one expert (MoE) or the projection (dense).

        Raises:
            InvalidFieldError: the module is not part of this spec.
        """
        if module in ("gate", "up"):
            return (self.hidden_size, self.moe_intermediate_size)
        if module == "down":
            return (self.moe_intermediate_size, self.hidden_size)
        if module in self.dense_shapes:
            return self.dense_shapes[module]
        raise InvalidFieldError("module", f"{module!r} is not a module of this layer (MoE {MOE_MODULES}, "
                                          f"dense {tuple(self.dense_shapes)})")
