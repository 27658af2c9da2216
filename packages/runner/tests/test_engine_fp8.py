"""The engine on an fp8 block-scaled checkpoint (DESIGN.md §1, "Quantized base"): refused at start-up,
by name, before any weight is read.

Covers: a backend that does not declare ``base_quant=fp8_block`` (csgmv) → ``UnsupportedBaseQuantError``
naming it; the engine's model, which does not run an fp8 base yet → ``EngineConfigError`` on ``model``
(never a silent cast of fp8 codes to the compute dtype).
"""

import pytest

from moelora_core import UnsupportedBaseQuantError
from moelora_runner.engine import Engine, EngineConfigError

MODEL = "qwen3_moe_fp8"


def test_a_backend_not_declaring_fp8_is_refused_by_name(fixture_set):
    with pytest.raises(UnsupportedBaseQuantError, match=r"^backend 'csgmv' does not declare base_quant=fp8_block$"):
        Engine(fixture_set.model_dir(MODEL), backend="csgmv")


def test_the_engine_refuses_an_fp8_base_it_does_not_serve(fixture_set):
    with pytest.raises(EngineConfigError, match="fp8 block-scaled checkpoint"):
        Engine(fixture_set.model_dir(MODEL), backend="reference")
