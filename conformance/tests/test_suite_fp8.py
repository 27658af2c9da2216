"""The suite's fp8 block-scaled base (DESIGN.md §1, "Quantized base"; P14).

Covers: which built-in backends declare ``fp8_block`` (P14 runs on them; csgmv is "not
implemented"); a quantized case keeps its inputs and adapters and quantizes every MoE layer's
experts with gate's and up's own scale grids; the harness refuses a quantized layer on a backend that
does not declare it, by name; the two fp8 mutants are registered.
"""

import pytest
import torch

from moelora_conformance.faulty import MUTANTS
from moelora_conformance.strategies.cases import quantize_base_fp8
from moelora_core import LoRALayerSpec, MoEBaseWeights, UnsupportedBaseQuantError, load_backend
from moelora_core.backend import check_base_quant_served


@pytest.mark.parametrize("name, declared", [("reference", True), ("triton", True), ("csgmv", False)])
def test_built_in_backends_declare_what_they_serve(name, declared):
    spec = LoRALayerSpec(16, 16, 2, 1, {}, 1, 2)
    caps = load_backend(name)(spec).capabilities()
    assert caps.fp8_block_base is declared
    if not declared:
        with pytest.raises(UnsupportedBaseQuantError, match="does not declare base_quant=fp8_block"):
            check_base_quant_served(name, caps, "fp8_block")


def test_quantized_base_keeps_shapes_and_uses_each_halfs_grid():
    gen = torch.Generator().manual_seed(0)
    base = MoEBaseWeights(torch.randn(3, 2 * 20, 24, generator=gen), torch.randn(3, 24, 20, generator=gen))
    q = quantize_base_fp8(base, (8, 16))
    assert q.base_quant == "fp8_block" and q.w_gate_up.shape == base.w_gate_up.shape
    assert tuple(q.w_gate_up_scale_inv.shape) == (3, 2 * 3, 2)  # ⌈20/8⌉ = 3 row blocks per half
    assert tuple(q.w_down_scale_inv.shape) == (3, 3, 2)


def test_the_fp8_mutants_are_registered():
    assert {"fp8-quantized-shrink", "fp8-skips-deltas"} <= set(MUTANTS)
