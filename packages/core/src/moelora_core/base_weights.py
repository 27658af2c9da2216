"""Base (non-LoRA) weights of one MoE layer in moelora's layout.

The checkpoint readers produce this from any supported family (per-expert keys, Mixtral's
w1/w3/w2, or the fused 3-D form); the oracle, the reference path, the Triton base MoE and the
suite's harness all consume it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelora_core.errors import InvalidFieldError
from moelora_core.fp8_block import FP8_DTYPE, check_block, gate_up_scale_rows, scale_grid
from moelora_core.moe_activation import SILU, MoEActivation
from moelora_core.routing import GroupLimitedRouting


@dataclass
class MoEBaseWeights:
    """Stacked expert weights of one MoE block.

    Attributes:
        w_gate_up: [E_base, 2I, H]; rows [:I] are gate (Mixtral w1), rows [I:] are up (w3).
        w_down: [E_base, H, I] (Mixtral w2).
        router: [E, H] router (gate) weight, or None where routing is given.
        num_experts: E, the routed experts LoRA applies to. ``E_base >= E``; ids in
            ``[E, E_base)`` are extra fused experts (e.g. a shared expert) without LoRA.
        norm_topk_prob: renormalise the top-k router weights to sum to 1.
        b_gate_up: [E_base, 2I] expert biases of the gate/up projection (halves layout, like
            ``w_gate_up``), or None (GPT-OSS has them; DESIGN.md §1).
        b_down: [E_base, H] expert biases of the down projection (router-weighted with it), or None.
        router_bias: [E] the router's bias (GPT-OSS), or None.
        activation: the expert activation (:data:`~moelora_core.moe_activation.SILU` unless the
            family says otherwise, e.g. GPT-OSS's ``SWIGLU_OAI``).
        weight_block: (bn, bk) of an fp8 block-scaled base (``base_quant`` "fp8_block", DESIGN.md §1),
            or None. Then ``w_gate_up`` / ``w_down`` are float8_e4m3fn and the scales are given.
        w_gate_up_scale_inv: [E_base, 2·⌈I/bn⌉, ⌈H/bk⌉] fp32: gate's blocks (rows [:⌈I/bn⌉]) then
            up's, each half on its own grid (``moelora_core.fp8_block.gate_up_scale_rows``).
        w_down_scale_inv: [E_base, ⌈H/bn⌉, ⌈I/bk⌉] fp32.
        routing: DeepSeek-V3's group-limited sigmoid routing, or None for softmax top-k
            (:mod:`moelora_core.routing`; computed by ``moelora_reference.routing.route``).
        router_correction_bias: [E] DeepSeek-V3's ``e_score_correction_bias`` (selection only), or
            None; only with ``routing``.

    Raises:
        InvalidFieldError: inconsistent shapes.
    """

    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    router: torch.Tensor | None = None
    num_experts: int | None = None
    norm_topk_prob: bool = True
    b_gate_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    router_bias: torch.Tensor | None = None
    activation: MoEActivation = SILU
    weight_block: tuple[int, int] | None = None
    w_gate_up_scale_inv: torch.Tensor | None = None
    w_down_scale_inv: torch.Tensor | None = None
    routing: GroupLimitedRouting | None = None
    router_correction_bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.w_gate_up.dim() != 3 or self.w_gate_up.shape[1] % 2:
            raise InvalidFieldError("w_gate_up", f"expected [E, 2I, H], got {tuple(self.w_gate_up.shape)}")
        e_base, two_i, h = self.w_gate_up.shape
        if tuple(self.w_down.shape) != (e_base, h, two_i // 2):
            raise InvalidFieldError("w_down", f"expected {(e_base, h, two_i // 2)}, got {tuple(self.w_down.shape)}")
        if self.num_experts is None:
            self.num_experts = e_base
        if not 1 <= self.num_experts <= e_base:
            raise InvalidFieldError("num_experts", f"must be in [1, {e_base}], got {self.num_experts}")
        if self.router is not None and tuple(self.router.shape) != (self.num_experts, h):
            raise InvalidFieldError("router", f"expected {(self.num_experts, h)}, got {tuple(self.router.shape)}")
        for name, shape in (("b_gate_up", (e_base, two_i)), ("b_down", (e_base, h)),
                            ("router_bias", (self.num_experts,)),
                            ("router_correction_bias", (self.num_experts,))):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != shape:
                raise InvalidFieldError(name, f"expected {shape}, got {tuple(value.shape)}")
        self._check_fp8(e_base, two_i // 2, h)
        if self.router_correction_bias is not None and self.routing is None:
            raise InvalidFieldError("router_correction_bias", "only group-limited routing has a correction bias")

    def _check_fp8(self, e_base: int, inter: int, h: int) -> None:
        fp8 = [n for n in ("w_gate_up", "w_down") if getattr(self, n).dtype == FP8_DTYPE]
        if self.weight_block is None:
            if fp8 or self.w_gate_up_scale_inv is not None or self.w_down_scale_inv is not None:
                raise InvalidFieldError("weight_block", f"fp8 weights or scales given ({fp8 or 'scales'}) without "
                                                        "a block size")
            return
        bn, bk = self.weight_block = check_block(self.weight_block)
        if len(fp8) != 2:
            raise InvalidFieldError("w_gate_up", f"weight_block given: both expert weights must be {FP8_DTYPE}, "
                                                 f"got {self.w_gate_up.dtype} / {self.w_down.dtype}")
        for name, shape in (("w_gate_up_scale_inv", (e_base, gate_up_scale_rows(inter, bn), -(-h // bk))),
                            ("w_down_scale_inv", (e_base, *scale_grid(h, inter, (bn, bk))))):
            value = getattr(self, name)
            if value is None:
                raise InvalidFieldError(name, "missing: an fp8 block-scaled weight needs its scales")
            if tuple(value.shape) != shape:
                raise InvalidFieldError(name, f"expected {shape} at block {[bn, bk]}, got {tuple(value.shape)}")

    @property
    def base_quant(self) -> str:
        """``"fp8_block"`` for fp8 block-scaled experts, else ``"none"`` (``LoRALayerSpec.base_quant``)."""
        return "none" if self.weight_block is None else "fp8_block"

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] → [T, E] router logits ``x W_rᵀ (+ b_r)``, in x's dtype (GPT-OSS's router has a bias).

        Raises:
            InvalidFieldError: no router weight.
        """
        if self.router is None:
            raise InvalidFieldError("router", "this MoE block holds no router weight")
        logits = x @ self.router.to(x.dtype).T
        return logits if self.router_bias is None else logits + self.router_bias.to(x.dtype)

    @property
    def hidden_size(self) -> int:
        return self.w_gate_up.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w_gate_up.shape[1] // 2
