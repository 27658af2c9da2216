"""The fp8 logprob rows' measurement (``hf_check.fp8_crossings``), its parts on tiny inputs.

Covers: the embedding perturbation is one fp32 rounding (each element moved by at most 2^-23 of itself,
many moved, none once the block ends); the move statistics; the fault maker refuses a model with no w8a8
experts by name. (Its use on the fixtures: ``test_engine_fp8.py`` and ``test_fixtures_fp8.py`` hold the
faults over the rows' mean bound.)
"""

from __future__ import annotations

import pytest
import torch

from moelora_conformance.hf_check.fp8_crossings import (
    EMBEDDING_NOISE,
    moves,
    perturbed_embeddings,
    with_quantized_expert_deltas,
)


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 32)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids)


def test_the_perturbation_is_one_fp32_rounding_and_ends_with_its_block():
    torch.manual_seed(0)
    model, ids = _Tiny().requires_grad_(False), torch.arange(16)
    clean = model(ids)
    with perturbed_embeddings(model, seed=1):
        moved = model(ids)
    rel = ((moved.double() - clean.double()).abs() / clean.double().abs()).max()
    assert 0 < float(rel) <= 1.5 * EMBEDDING_NOISE  # the noise (<= 2^-23 of each element) and fp32's rounding
    assert float((moved != clean).float().mean()) > 0.5  # most elements moved by an ulp
    assert torch.equal(model(ids), clean)  # the hook is gone


def test_moves_counts_every_logprob():
    m = moves("x", [torch.tensor([0.0, 1e-3]), torch.tensor([2e-5])], [torch.zeros(2), torch.zeros(1)])
    assert (m.count, m.over) == (3, 1)
    assert m.max_abs == pytest.approx(1e-3) and m.mean_abs == pytest.approx((1e-3 + 2e-5) / 3)
    assert m.median_abs == pytest.approx(2e-5)


def test_the_fault_needs_w8a8_experts():
    with pytest.raises(ValueError, match="no w8a8 experts module"):
        with_quantized_expert_deltas(_Tiny())
