"""The suite's cases are well-formed: the whole suite runs against the inspecting backend, which
checks every call the harness makes against the protocol (and answers with the reference).

Covers: the suite passes on ``moelora_conformance.harness.inspecting:make_backend`` (so no property
hands a backend a malformed batch, foreign metadata, a mismatched pool, wrong dtypes or shapes);
the inspecting backend does refuse each kind of malformed call (so the run above could fail) and
records the calls it sees.
"""

import pytest
import torch

from moelora_conformance.harness.inspecting import InspectingBackend, MalformedCallError
from moelora_conformance.report import unexpected_failures
from moelora_conformance.session import run_suite
from moelora_core import BatchSpec, ForwardMode, LoRALayerSpec, LoRAWeights, ModuleLoRA, Request
from moelora_reference.backend import make_backend as make_reference

TARGET = "moelora_conformance.harness.inspecting:make_backend"


@pytest.mark.slow
def test_the_suite_passes_on_the_inspecting_backend(tmp_path, record_property):
    run = run_suite(TARGET, profile="interpret", max_examples=5, report_json=tmp_path / "report.json")
    record_property("seconds", round(run.seconds, 1))
    assert run.report is not None, run.output[-4000:]
    assert run.returncode == 0 and not unexpected_failures(run.report), run.output[-6000:]
    assert {r["outcome"] for r in run.report["records"]} == {"passed"}
    assert run.report["backend"]["name"] == "inspecting"


def _spec(dtype=torch.float32):
    return LoRALayerSpec(hidden_size=8, moe_intermediate_size=6, num_experts=3, top_k=2, dense_shapes={"q": (8, 5)},
                         max_loras=2, max_rank=4, dtype=dtype)


def _pool(spec, rank=2):
    g = torch.Generator().manual_seed(0)
    w = LoRAWeights(spec)
    mods = {m: ModuleLoRA(torch.randn(3, rank, 8 if m != "down" else 6, generator=g),
                          torch.randn(3, 6 if m != "down" else 8, rank, generator=g), 0.5) for m in ("gate", "up", "down")}
    w.load_slot(0, mods)
    return w


def _batch(w, slots=(0, -1)):
    return BatchSpec(ForwardMode.EXTEND, [Request(s, 2) for s in slots], 2, w.slot_ranks(), w.slot_scalings())


def _gate_up(backend, w, info, T=4, dtype=None):
    """A gate_up delta call with T rows of activations in ``dtype`` (the spec's by default)."""
    spec = backend.spec
    x = torch.randn(T, spec.H).to(dtype or spec.dtype)
    ids = torch.zeros(T, spec.top_k, dtype=torch.int32)
    out = torch.zeros(T, spec.top_k, 2 * spec.I)
    backend.moe_gate_up_delta(x, ids, out, w, info)


def _inspected():
    """(an inspecting backend, a pool with slot 0 loaded) on the small spec."""
    spec = _spec()
    return InspectingBackend(spec), _pool(spec)


def test_a_well_formed_call_passes_and_is_recorded():
    backend, w = _inspected()
    _gate_up(backend, w, backend.prepare(_batch(w)))
    assert [c.method for c in backend.calls] == ["prepare", "moe_gate_up_delta"]
    assert backend.calls[1].shapes == ((4, 8), (4, 2), (4, 2, 12))


def test_foreign_metadata_is_refused():
    backend, w = _inspected()
    foreign = make_reference(backend.spec).prepare(_batch(w))
    with pytest.raises(MalformedCallError, match="did not return"):
        _gate_up(backend, w, foreign)


def test_activations_of_another_dtype_are_refused():
    backend, w = _inspected()
    info = backend.prepare(_batch(w))
    with pytest.raises(MalformedCallError, match="dtype"):
        _gate_up(backend, w, info, dtype=torch.float16)


def test_a_batch_that_misdescribes_the_pool_is_refused():
    backend, w = _inspected()  # slot 0 holds rank 2 in this layer's pool
    wrong = BatchSpec(ForwardMode.EXTEND, [Request(0, 2), Request(-1, 2)], 2, (1, 0), w.slot_scalings())
    info = backend.prepare(wrong)
    with pytest.raises(MalformedCallError, match="ranks"):
        _gate_up(backend, w, info)


def test_a_batch_rank_above_this_layers_is_the_slots_rank_in_another_layer():
    # a slot's batch rank is its largest over the layers (AdapterPool.slot_ranks): with a rank_pattern
    # key naming a layer (P13) one layer's pool holds less than the batch says, and that is right
    backend, w = _inspected()
    larger = BatchSpec(ForwardMode.EXTEND, [Request(0, 2), Request(-1, 2)], 2, (3, 0), w.slot_scalings())
    _gate_up(backend, w, backend.prepare(larger))


def test_rows_that_disagree_with_the_metadata_are_refused():
    backend, w = _inspected()
    info = backend.prepare(_batch(w))
    with pytest.raises(MalformedCallError, match="shape"):
        _gate_up(backend, w, info, T=5)  # the batch has 4 tokens


def test_preparing_a_graph_family_before_its_init_is_refused():
    backend, w = _inspected()
    with pytest.raises(MalformedCallError, match=r"before init_graph\(.decode."):
        backend.prepare(_batch(w), "decode")
