"""Helpers of the graph-runner tests: graph settings by mode name, the graph-vs-eager comparison with
its measurement, the pass counts of an engine, and faulty backends (loaded by ``module:factory``) that
break one rule of graph mode each.

``MOELORA_RUNNER_DTYPE`` (default float32) is the compute dtype of the graph tests' engines: the GPU
run sets bfloat16 (real CUDA graphs, bf16). ``MOELORA_GPU_OUT`` collects each graph-vs-eager
measurement in ``graph_vs_eager.jsonl`` there (the rows of ``moelora_core.tolerance``).
"""

from __future__ import annotations

import dataclasses
import os

import runner_support as rs
import torch

from moelora_conformance.e2e import engine_checks
from moelora_core.capabilities import Fallback

#: Compute dtype of the graph tests' engines.
DTYPE = os.environ.get("MOELORA_RUNNER_DTYPE", "float32")
#: Exact (bitwise) comparisons where the run is deterministic: the CPU.
EXACT = rs.DEVICE == "cpu"

#: Engine arguments of each graph mode under test (each runs its decodes on the decode graph).
MODES: dict[str, dict] = {
    "eager": dict(graph="eager", decode_graph=False),
    "decode_graph": dict(graph="eager", decode_graph=True),
    "full": dict(graph="full", decode_graph=True),
    "breakable": dict(graph="breakable", decode_graph=True),
}

#: ``mode`` labels a graph mode's passes carry, by phase.
PASS_MODES: dict[str, dict[str, str]] = {
    "decode_graph": {"prefill": "eager", "decode": "decode_graph"},
    "full": {"prefill": "full", "decode": "decode_graph"},
    "breakable": {"prefill": "breakable", "decode": "decode_graph"},
}


passes = engine_checks.passes


def assert_ran_on_graphs(engine, mode: str) -> None:
    """Every prefill and decode pass of ``engine`` (or a :func:`passes` dict of one) ran in ``mode``'s
    graph labels with reason "" (the decode_graph mode runs prefills eagerly with reason "disabled");
    at least one of each."""
    counted = engine if isinstance(engine, dict) else passes(engine)
    want = PASS_MODES[mode]
    for (phase, got_mode, reason), n in counted.items():
        if phase == "idle":
            continue
        expected_reason = "disabled" if want[phase] == "eager" else ""
        assert (got_mode, reason) == (want[phase], expected_reason), f"{n} {phase} passes ran {got_mode}/{reason!r}"
    for phase in ("prefill", "decode"):
        assert any(p == phase for p, _, _ in counted), f"no {phase} pass ran: {counted}"


def compare_outputs(got, want, *, what: str, dtype: str = DTYPE, record: dict | None = None,
                    comparison: str = "graph_vs_eager") -> tuple[float, float]:
    """:func:`moelora_conformance.e2e.engine_checks.compare_outputs` with this run's dtype and device, in
    the ``comparison`` row (``graph_vs_eager``; the TP tests pass ``tp_vs_tp1``), its measurement appended
    to ``$MOELORA_GPU_OUT/<comparison>.jsonl`` when that is set."""
    out_dir = os.environ.get("MOELORA_GPU_OUT")
    path = os.path.join(out_dir, f"{comparison}.jsonl") if out_dir else None
    return engine_checks.compare_outputs(got, want, what=what, dtype=dtype, record_path=path, record=record,
                                         device=rs.DEVICE, comparison=comparison)


def assert_same_outputs(got, want, *, what: str) -> None:
    """Bitwise the same tokens and logprobs on the CPU; within ``graph_vs_eager`` elsewhere."""
    if not EXACT:
        compare_outputs(got, want, what=what)
        return
    for a, b in zip(got, want):
        assert a.output_token_ids == b.output_token_ids, (what, a.request_id)
        assert a.finish_reason == b.finish_reason, (what, a.request_id)
        mine = (a.prompt_logprobs or [None])[1:] + a.output_logprobs
        theirs = (b.prompt_logprobs or [None])[1:] + b.output_logprobs
        assert torch.equal(torch.tensor(mine, dtype=torch.float64), torch.tensor(theirs, dtype=torch.float64)), \
            (what, a.request_id, mine, theirs)


# --- backends that break one graph-mode rule each (module:factory targets) ------------------------------

#: Calls of :func:`make_spying_backend` backends' graph-mode prepare: (backend id, bs, has_active_lora).
GRAPH_PREPARES: list[tuple[int, int, bool]] = []


def _reference():
    from moelora_reference.backend import ReferenceBackend

    return ReferenceBackend


def _graph_prepare_hook(name: str, hook):
    """A reference-backend factory whose graph-mode ``prepare`` answers ``hook(backend, batch, info)``
    instead of ``info`` (``Fallback`` answers pass through untouched)."""

    def factory(spec):
        class Hooked(_reference()):
            def prepare(self, batch, family=None, bucket=None):
                info = super().prepare(batch, family, bucket)
                if family is None or isinstance(info, Fallback):
                    return info
                return hook(self, batch, info)

        Hooked.name = name
        return Hooked(spec)

    return factory


def _spy(backend, batch, info):
    GRAPH_PREPARES.append((id(backend), batch.bs, info.has_active_lora))
    return info


def _inactive(backend, batch, info):
    info.has_active_lora = batch.has_active_lora
    return info


#: The reference backend, recording every graph-mode prepare (capture batches have bs 0).
make_spying_backend = _graph_prepare_hook("spying-reference", _spy)
#: Fault: graph-mode ``has_active_lora`` from the batch (False on a base-only or empty batch), so a
#: graph captured then would never run the LoRA kernels.
make_inactive_capture_backend = _graph_prepare_hook("inactive-capture", _inactive)
#: Fault: graph-mode metadata in a fresh tensor per prepare (a replay would read the captured one).
make_reallocating_backend = _graph_prepare_hook(
    "reallocating", lambda backend, batch, info: dataclasses.replace(info, weight_indices=info.weight_indices.clone()))


#: ``id`` of every backend :func:`make_counting_backend` built.
BACKENDS_BUILT: list[int] = []


def make_counting_backend(spec):
    """The reference backend, recording every instance the factory builds (``BACKENDS_BUILT``)."""
    backend = _reference()(spec)
    BACKENDS_BUILT.append(id(backend))
    return backend


def make_two_request_backend(spec):
    """A backend whose graph families hold at most two requests (``Fallback`` beyond)."""

    class TwoRequests(_reference()):
        name = "two-requests"

        def prepare(self, batch, family=None, bucket=None):
            if family is not None and batch.bs > 2:
                return Fallback(f"{batch.bs} requests > 2 (test backend)")
            return super().prepare(batch, family, bucket)

    return TwoRequests(spec)


def make_no_graph_backend(spec):
    """The reference backend declaring no graph family."""

    class NoGraphs(_reference()):
        name = "no-graphs"

        def capabilities(self):
            return dataclasses.replace(super().capabilities(), graph_families=frozenset(),
                                       prefill_graph_modes=frozenset())

    return NoGraphs(spec)
