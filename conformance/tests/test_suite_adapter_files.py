"""Adapters the suite writes as real PEFT files (P13), and what they are checked against.

Covers: the simplest file adapter — the first example of every P13 item — is a fused rsLoRA adapter
of rank 2; over drawn file adapters (fused and per-expert, rsLoRA, patterns, fp16 / bf16 stored,
two layers) moelora's reader gives exactly the factors and σ the suite expects from the files
(peft's reading, the per-module reference), and the suite's description of each layer (ranks and α
after ``rank_pattern`` / ``alpha_pattern`` keys naming a layer, matched by peft's own rule) is what
peft built in that layer; a reader that drops the rsLoRA flag fails P13 on its
first example (before, no run's adapters passed through a reader); without the ``fixtures`` extra
P13 is reported ``not_run``.
"""

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, given, settings

from moelora_conformance.peft_files import FileAdapter, Geometry, PeftFiles, file_adapters, peft_available
from moelora_conformance.plugin import not_run_reason
from moelora_conformance.properties.registry import PROPERTIES, Property
from moelora_conformance.session import run_suite
from moelora_conformance.strategies import LayerShape

pytestmark = pytest.mark.skipif(not peft_available(), reason="needs the fixtures extra (transformers, peft)")
GEOMETRY = Geometry(2, 1, 4)
SHAPE = LayerShape(hidden_size=8, moe_intermediate_size=6, num_experts=3, num_base_experts=3, top_k=2, dense_shapes=GEOMETRY.dense_shapes(8, ("q", "k", "v", "o")), max_loras=2, max_rank=4)


def test_the_simplest_file_adapter_is_an_rslora_adapter_of_rank_2():
    simplest = find(file_adapters(SHAPE), lambda a: True)
    assert (simplest.format, simplest.use_rslora, simplest.r) == ("fused", True, 2), simplest.describe()
    assert simplest.slot_adapter().scaling("gate") == pytest.approx(simplest.alpha / 2**0.5)


def test_moelora_reads_every_drawn_file_as_the_suite_expects_it():
    from moelora_core.checkpoint import read_adapter

    files = PeftFiles(Path(tempfile.mkdtemp(prefix="moelora-files-")))
    config = files.model_config(SHAPE, GEOMETRY, 2)
    seen = set()

    @settings(max_examples=25, phases=[Phase.generate], derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(adapter=file_adapters(SHAPE, layers=2))
    def check(adapter: FileAdapter):
        built = files.build(adapter, SHAPE, GEOMETRY, 2)
        read = read_adapter(built.path, config, dtype=torch.float32, max_rank=SHAPE.max_rank)
        layered = adapter.modules(0) != adapter.modules(1)  # a key naming a layer changed a rank or α
        seen.add((adapter.format, adapter.use_rslora, adapter.stored_dtype, bool(adapter.rank_pattern), layered))
        for n, (want, got) in enumerate(zip(built.expected, read.layers, strict=True)):
            assert set(want) == set(got), adapter.describe()
            described = {m: (r, a) for m, r, a in adapter.modules(n)}
            for m, w in want.items():
                g = got[m]
                assert torch.equal(w.lora_A.float(), g.lora_A.float()), (adapter.describe(), m)
                assert torch.equal(w.lora_B.float(), g.lora_B.float()), (adapter.describe(), m)
                assert w.scaling == pytest.approx(g.scaling, rel=1e-6), (adapter.describe(), m)
                # the suite's description of layer n (peft's key matching) is what peft built there
                r, alpha = described[m]
                assert w.lora_A.shape[-2] == r, (adapter.describe(), n, m)
                assert w.scaling == pytest.approx(alpha / (r**0.5 if adapter.use_rslora else r), rel=1e-6), \
                    (adapter.describe(), n, m)

    check()
    assert {f for f, *_ in seen} == {"fused", "legacy"} and {rs for _, rs, *_ in seen} == {True, False}
    assert any(s[-1] for s in seen), "no drawn file had a layer-specific rank or α"


@pytest.mark.slow
def test_a_reader_dropping_the_rslora_flag_fails_p13_on_its_first_example():
    run = run_suite("moelora_conformance.faulty:make_reader_drops_rslora", profile="interpret", max_examples=1,
                    no_shrink=True, extra=["-k", "test_adapters_read_from_peft_files and eager-fp32"])
    assert run.returncode == 1, run.output[-3000:]
    (rec,) = run.report["records"]
    # the first check to fail is the output's (named an output, not a delta: the values compared are outputs)
    assert rec["outcome"] == "failed" and rec["message"].startswith("OutputMismatch:"), rec
    assert "MoE output" in rec["message"] and "output max_rel=" in rec["message"], rec
    assert any("file fused r2" in t and "/rs" in t for t in rec["repro"]["trace"]), rec["repro"]["trace"]


def test_a_property_whose_modules_are_missing_is_not_run():
    assert not_run_reason(PROPERTIES["P01"]) is None
    missing = Property("P99", "t", ("eager",), requires=("no_such_module_for_moelora",))
    assert not_run_reason(missing).startswith("not run: needs no_such_module_for_moelora")
    assert PROPERTIES["P13"].requires == ("transformers", "peft", "safetensors")
