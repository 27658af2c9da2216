"""The stateful engine properties (E06, ``moelora_conformance.e2e.stateful``) on the engine.

- ``test_engine_histories_keep_every_property``: the Hypothesis state machine, CI-sized — 20
  examples (``MOELORA_MAX_EXAMPLES`` overrides), 3 slots for the 5 engine adapters of one family
  (slots evicted and reused), each example in a mode it draws (eager, decode graph, prefill
  ``full``, prefill ``breakable``) — on the reference backend: every finished request equals itself
  alone on a fresh engine with the weights it was admitted with, slots hold exactly their adapters,
  every step runs where the graph configuration says, refusals change nothing, everything is freed.
- ``test_named_history``: the named histories (``e2e.stateful_histories``), one per public
  engine-level fault class (an evicted slot reused with the old adapter's modules, a hot load during
  decode, chunked prefill interleaved with decodes, idle steps between batches, N adapters + base
  overflowing the batch, a prefill past 32 requests, a decode batch shrinking inside its bucket),
  on the reference backend; triton and csgmv (under the interpreter) run the decode-graph history in
  the ``interpret`` profile and every history beyond it.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import runner_support as rs

from moelora_conformance.e2e.stateful import run_state_machine
from moelora_conformance.e2e.stateful_histories import HISTORIES, run_history
from moelora_conformance.profiles import current_profile

MODEL = "qwen3_moe"
#: The engine adapters in the histories' order (0: MoE + attention, 3: attention only, 4: registered later).
ORDER = ("eng-fused-r8", "eng-rslora-r6", "eng-legacy-r3", "eng-attn-r5-fp16", "eng-pattern-r4")
KERNEL_BACKENDS = ("triton", "csgmv") if importlib.util.find_spec("moelora_backends") else ()
#: The histories the kernel backends run in the interpret profile (CI): the decode graph's; every one beyond it.
KERNEL_HISTORIES = ("decode-batch-shrinks-in-a-bucket",) if current_profile().name == "interpret" else tuple(HISTORIES)


def _adapters(engine_adapters) -> dict:
    by_suffix = {name.removeprefix(f"{MODEL}-"): path for name, path in engine_adapters[MODEL]}
    return {f"{MODEL}-{s}": by_suffix[s] for s in ORDER}


#: Backends of the state machine: every backend beyond the interpret profile. In it (CI) none: the
#: reference's run is the main job's E06 (noxfile.py MAIN_CHECKS e2e-reference: this machine, these
#: adapters, 20 examples, seed 0), so the claim keeps that one home there.
MACHINE_BACKENDS = () if current_profile().name == "interpret" else ("reference", *KERNEL_BACKENDS)
#: ``MOELORA_RUNNER_DTYPE`` (e.g. bfloat16 on the GPU); fp32 by default.
DTYPE = os.environ.get("MOELORA_RUNNER_DTYPE", "float32")


@pytest.mark.slow
@pytest.mark.parametrize("backend", MACHINE_BACKENDS)
def test_engine_histories_keep_every_property(backend, fixture_set, engine_adapters, record_property):
    examples = int(os.environ.get("MOELORA_MAX_EXAMPLES", "20"))
    results = run_state_machine(backend=backend, model_dir=fixture_set.model_dir(MODEL),
                                adapters=_adapters(engine_adapters), max_examples=examples, max_loras=3,
                                device=rs.DEVICE, dtype=DTYPE)
    (result,) = results
    record_property("details", {k: v for k, v in result.details.items() if k != "failing_steps"})
    assert result.outcome == "passed", f"{result.message}\n{result.details.get('failing_steps', '')}"
    d = result.details
    assert d["examples"] >= examples and d["requests_checked"] > 0 and d["evictions"] > 0 and d["refusals"] > 0, d
    assert set(d["examples_by_mode"]) == {"eager", "decode_graph", "full", "breakable"}, d["examples_by_mode"]


_CASES = [pytest.param("reference", name, marks=pytest.mark.xdist_group("graphs-reference")) for name in HISTORIES] + \
    [pytest.param(backend, name, marks=[pytest.mark.interpreter, pytest.mark.xdist_group(f"graphs-{backend}")])
     for backend in KERNEL_BACKENDS for name in KERNEL_HISTORIES]


@pytest.mark.parametrize(("backend", "name"), _CASES)
def test_named_history(backend, name, fixture_set, engine_adapters):
    if backend != "reference":
        pytest.importorskip("triton")
    run_history(name, backend=backend, model_dir=fixture_set.model_dir(MODEL), adapters=_adapters(engine_adapters),
                device=rs.DEVICE, dtype=DTYPE)
