"""What every property module uses: the suite's session settings, drawing cases in a mode, and a
:class:`Subject` — one backend on one case's layer, driven in one harness mode.

Drawing: :func:`draw_case` draws the case (structure and seed) for a mode and dtype within the
profile's caps bounded by the backend's declared limits, and starts the example's trace: the
lines a failure report prints (the case's ``describe()`` and every batch the property ran), which
the plugin attaches to the failure with a repro command. :func:`draw_routing`,
:func:`draw_moe_path` and :func:`draw_capacity` draw the rest of an example's structure;
:func:`assert_outputs_close` compares two runs of the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from hypothesis import note
from hypothesis import strategies as st

from moelora_conformance.harness import (
    MOE_PATHS,
    BatchInputs,
    CheckContext,
    GraphLayer,
    Layer,
    LayerOutput,
    Oracle,
    assert_close,
    check_run,
)
from moelora_conformance.harness.checks import OracleMismatch
from moelora_conformance.profiles import Profile, SizeCaps
from moelora_conformance.strategies.cases import MaterializedCase, MoELoRACase
from moelora_conformance.strategies.routing import routing_plans
from moelora_conformance.strategies.suite import family_of, suite_cases, tokens_per_request
from moelora_core.backend import BackendFactory
from moelora_core.backend_checks import GraphCapacity
from moelora_core.batch import BatchSpec
from moelora_core.capabilities import Capabilities, Fallback
from moelora_core.forward_mode import ForwardMode


@dataclass(kw_only=True)
class Suite:
    """The session's settings, built by the plugin.

    Attributes:
        target: the ``--backend`` string. factory: the backend factory.
        name, version: the backend's. capabilities: what it declares.
        device: where cases are materialized and run.
        profile: the loaded profile. caps: its size caps bounded by the backend's limits.
        oracle_rows: rows the per-token oracle checks per run (None = all).
        origin: where the factory came from (module, file, distribution; the report header).
        workdir: a directory of the session for files the suite writes (adapter files, P13).
    """

    target: str
    factory: BackendFactory
    name: str
    version: str
    capabilities: Capabilities
    device: torch.device
    profile: Profile
    caps: SizeCaps
    oracle_rows: int | None = None
    origin: dict | None = None
    workdir: Path | None = None
    _peft_files: object = field(default=None, repr=False)

    def peft_files(self):
        """The session's :class:`~moelora_conformance.peft_files.PeftFiles` (built on first use, in
        ``workdir``)."""
        if self._peft_files is None:
            from moelora_conformance.peft_files import PeftFiles

            if self.workdir is None:
                raise ValueError("the suite has no work directory for adapter files")
            self._peft_files = PeftFiles(self.workdir)
        return self._peft_files

    @property
    def moe_paths(self) -> tuple[str, ...]:
        """The MoE paths drawn: both ``deltas`` paths, and ``fused`` where declared."""
        return tuple(p for p in MOE_PATHS if p != "fused" or self.capabilities.fused_moe)

    @property
    def virtual_experts(self) -> bool | None:
        """For case strategies: None (drawn) where declared, else False."""
        return None if self.capabilities.virtual_experts else False


# --- the trace of the running example -----------------------------------------------------------

#: Prefix of the example's trace lines among Hypothesis' notes of a failure (the plugin reads them
#: back from the failing exception: each distinct failure carries its own example's lines).
TRACE_PREFIX = "moelora | "


def trace(line: str) -> None:
    """Add a line to the running example's trace: a Hypothesis ``note``, which Hypothesis attaches
    to the failure of that example (the plugin prints it in the repro)."""
    note(TRACE_PREFIX + line)


def trace_lines(exc: BaseException | None) -> list[str]:
    """The trace lines of the example that raised ``exc`` (from its notes, or its cause's)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        lines = [n[len(TRACE_PREFIX):] for n in getattr(exc, "__notes__", ()) if n.startswith(TRACE_PREFIX)]
        if lines:
            return lines
        exc = exc.__cause__ or exc.__context__
    return []


def draw_case(data: st.DataObject, suite: Suite, mode: str, dtype: torch.dtype, **kwargs) -> MoELoRACase:
    """Draw the example's case for ``mode`` and ``dtype`` and start its trace.

    Args:
        kwargs: passed to :func:`~moelora_conformance.strategies.suite.suite_cases` (kinds,
            adapter_modes, routing_modes, virtual_experts, extra_experts: by default drawn only where
            the backend declares ``fused_shared_experts``; shared_expert_factors: pools storing expert
            factors once per slot, by default where the backend declares ``shared_expert_factors``);
            caps: size caps tighter than the suite's (default: the suite's).
    """
    caps = kwargs.pop("caps", suite.caps)
    kwargs.setdefault("virtual_experts", suite.virtual_experts)
    kwargs.setdefault("extra_experts", suite.capabilities.fused_shared_experts)
    kwargs.setdefault("shared_expert_factors", suite.capabilities.shared_expert_factors)
    case = data.draw(suite_cases(caps, mode, dtype, **kwargs), label="case")
    trace(f"case: {case.describe()}")
    return case


def draw_routing(data: st.DataObject, case: MoELoRACase, sentinel_shares: tuple[float, ...], *,
                 label: str) -> MoELoRACase:
    """``case`` with drawn routing (``routing_plans``: a share of sentinel ids among ``sentinel_shares``,
    values from the case's seed), traced."""
    shape = case.shape
    routing = data.draw(routing_plans(shape.num_experts, shape.top_k, shape.num_base_experts,
                                      sentinel_shares=sentinel_shares, seed=case.seed), label=label)
    trace(f"routing: {routing.describe()}")
    return replace(case, routing=routing)


def draw_moe_path(data: st.DataObject, suite: Suite) -> str:
    """The MoE path of this example ("fused" only where the backend declares ``fused_moe``)."""
    path = data.draw(st.sampled_from(suite.moe_paths), label="moe path")
    trace(f"moe path: {path}")
    return path


def capacity_for(mode: str, batches: list[BatchSpec], *, extra_requests: int = 0,
                 extra_tokens: int = 0) -> GraphCapacity:
    """The smallest capacity of ``mode``'s graph family that fits every batch of ``batches``, plus
    slack: ``GraphCapacity.decode(max_bs, tokens_per_request)`` in "decode",
    ``GraphCapacity.prefill(max_num_tokens, max_num_requests)`` otherwise."""
    reqs = max([b.bs for b in batches] + [1]) + extra_requests
    if mode == "decode":
        tpr = next((tokens_per_request(b) for b in batches if b.forward_mode is ForwardMode.DECODE), 1)
        return GraphCapacity.decode(reqs, tpr)
    toks = max([b.num_tokens for b in batches] + [1]) + extra_tokens
    return GraphCapacity.prefill(toks, reqs)


def draw_capacity(data: st.DataObject, mode: str, batches: list[BatchSpec]) -> GraphCapacity | None:
    """A capacity for ``batches`` with drawn slack (0-3 requests, 0-16 tokens); None (nothing drawn)
    in eager mode."""
    if mode == "eager":
        return None
    cap = capacity_for(mode, batches, extra_requests=data.draw(st.integers(0, 3), label="request slack"),
                       extra_tokens=data.draw(st.integers(0, 16), label="token slack"))
    trace(f"capacity: {cap}")
    return cap


@dataclass
class Subject:
    """One backend on one case's layer, driven in one harness mode.

    Args:
        suite: the session. case: the case. mode: a layer mode.
        moe_path: "deltas", "deltas-model" or "fused". capacity: required for graph modes.
        materialized: reuse a case's values (a second backend on the same weights).
    """

    suite: Suite
    case: MoELoRACase
    mode: str
    moe_path: str = "deltas"
    capacity: GraphCapacity | None = None
    materialized: MaterializedCase | None = None
    layer: Layer = field(init=False)
    graph: GraphLayer | None = field(init=False, default=None)
    oracle: Oracle = field(init=False)
    ctx: CheckContext = field(init=False)

    def __post_init__(self) -> None:
        s = self.suite
        self.layer = Layer(s.factory, self.case, s.device, moe_path=self.moe_path, materialized=self.materialized)
        if family_of(self.mode) is not None:
            cap = self.capacity
            if cap is None:
                raise ValueError(f"mode {self.mode} needs a capacity")
            self.graph = GraphLayer(self.layer, self.mode, max_requests=cap.max_requests, max_tokens=cap.max_tokens,
                                    tokens_per_request=cap.tokens_per_request, pad_seed=self.case.seed)
        self.oracle = Oracle(self.layer, oracle_rows=s.oracle_rows)
        self.ctx = CheckContext(self.case.describe(), self.case.seed, self.case.dtype, s.device,
                                base_quant=self.layer.spec.base_quant)

    @property
    def backend(self):
        return self.layer.backend

    @property
    def m(self) -> MaterializedCase:
        return self.layer.m

    def inputs(self) -> BatchInputs:
        return self.layer.inputs()

    def run(self, inp: BatchInputs, *, allow_fallback: bool = False) -> LayerOutput:
        """One forward with LoRA in the subject's mode.

        Raises:
            AssertionError: a graph family fell back on a batch within its capacity.
        """
        if self.graph is None:
            return self.layer.eager(inp)
        out = self.graph.run(inp)
        if out.fallback is not None and not allow_fallback:
            raise AssertionError(f"{self.mode}: prepare returned {out.fallback} for a batch within the capacity "
                                 f"{self.capacity} ({inp.describe()}) | {self.ctx.describe}")
        return out

    def disabled(self, inp: BatchInputs, run: LayerOutput) -> LayerOutput:
        """The LoRA-disabled twin of ``run`` (same path, shapes and inputs)."""
        if self.graph is None or run.fallback is not None:
            return self.layer.disabled(inp, run)
        return self.graph.disabled(run)

    def check(self, inp: BatchInputs, run: LayerOutput, what: str, **kwargs) -> None:
        """The standard checks of ``run`` against the oracle and its LoRA-disabled twin (and pad
        rows in graph runs)."""
        base = self.disabled(inp, run)
        pad = self.graph is not None and run.fallback is None
        try:
            check_run(self.oracle, inp, run, base, self.ctx, f"{self.mode} {what}", pad_rows=pad, **kwargs)
        except OracleMismatch:
            raise
        except AssertionError as exc:
            raise OracleMismatch(str(exc)) from exc

    def run_and_check(self, inp: BatchInputs, what: str, **kwargs) -> LayerOutput:
        trace(f"{what}: {inp.describe()}")
        out = self.run(inp)
        self.check(inp, out, what, **kwargs)
        return out


def assert_outputs_close(out: LayerOutput, ref: LayerOutput, ctx: CheckContext, what: str, *,
                         rows: torch.Tensor | None = None, moe_in: bool = False) -> None:
    """``out``'s MoE output (and MoE input, with ``moe_in``), every further MoE layer's output and
    every dense output equal ``ref``'s within the dtype's tolerance; ``rows`` (a long index) picks
    the rows of ``ref`` that ``out`` ran.

    Raises:
        AssertionError: naming ``what`` and the output that differs.
    """
    pick = (lambda t: t) if rows is None else (lambda t: t[rows])
    assert_close(out.y, pick(ref.y).double(), ctx, f"{what}: MoE output")
    if moe_in:
        assert_close(out.moe_in, pick(ref.moe_in).double(), ctx, f"{what}: MoE input")
    for n, (e, e_ref) in enumerate(zip(out.extra, ref.extra, strict=True)):
        assert_close(e.y, pick(e_ref.y).double(), ctx, f"{what}: MoE layer {n + 2} output")
    for mod, t in out.dense.items():
        assert_close(t, pick(ref.dense[mod]).double(), ctx, f"{what}: dense {mod}")


def not_fallback(result, what: str):
    """``result`` of a ``prepare`` that must not be a ``Fallback``."""
    if isinstance(result, Fallback):
        raise AssertionError(f"{what}: prepare returned {result}")
    return result
