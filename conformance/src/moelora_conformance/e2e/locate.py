"""Where an e2e failure is (E01 / E02): the first step, layer and module at which the failing request's
module outputs depart from the reference engine's.

A :class:`Probe` wraps the LoRA calls of an engine's one backend instance (``dense_delta`` of q / k / v /
o and the shared expert's modules, ``moe_gate_up_delta``, ``moe_down_delta``): after the backend's own
call it copies the module's output (base + delta) into a static buffer per (layer, module). The copy is a
device op inside the forward, so a captured graph records it and every replay repeats it: eager passes
and graph replays are probed alike (DESIGN.md §6: the engine's graphs replay what capture recorded).
After every step the rows of one request are read back. :func:`first_departure` compares two probed
runs of the same request step by step, in the reference run's call order (layer 0's q, k, v, o — MLA's
q_a, q_b, kv_a, kv_b, o on DeepSeek-V3 —, MoE gate_up, down, shared expert or DeepSeek-V3's dense MLP,
then layer 1 ...), and names the first module whose rows differ by more than the dtype's bound.

On an fp8 block-scaled base (DESIGN.md §1, "Quantized base") two correct engines can depart at an fp8
dense projection without a fault: their unquantized inputs differ by a rounding (deltas summed in
another order), and where that straddles an e4m3 rounding midpoint one element of the quantized input
moves by a whole e4m3 step. The probe keeps each dense module's input too, and :func:`e4m3_crossing`
names such a departure "an e4m3 crossing" when the inputs agree within the dtype's bound, their
quantized values differ by one e4m3 step at a few elements each straddling its midpoint, and that
step accounts for the output's departure. (MoE modules are not classified: re-deriving their output
needs the routed experts' weights; a departure there is reported as any other.)

:func:`locate` reruns the failing request alone (the backend under test in the failing mode, and the
reference backend eagerly) and, when alone it does not depart (a fault that needs other requests in
the batch), the whole workload with the request's rows probed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

#: |Δ| <= ATOL + RTOL · max|reference| is "the same" (fp32; half types get the larger bound).
BOUNDS = {"float32": (1e-4, 1e-3), "float16": (2e-2, 2e-2), "bfloat16": (5e-2, 5e-2)}
#: At most this many elements of a module's quantized input may cross for the departure to read as
#: crossings: each is rare (≈ 2u|v|/step per element, ``tolerance._FP8_LOGPROB_NOTE``), so many at once
#: is a systematic difference, not roundings.
CROSSING_ELEMENTS = 4
_REQUEST = re.compile(r"\be2e-\d+\b")


def module_kind(module: str) -> str:
    """What a probed module belongs to: "shared expert" (``shared_*``), "dense MLP" (DeepSeek-V3's
    ``dense_*``), "MoE" (``gate_up``, ``down``), else "attention" (q/k/v/o; MLA's q_a/q_b/kv_a/kv_b)."""
    if module.startswith("shared"):
        return "shared expert"
    if module.startswith("dense_"):
        return "dense MLP"
    return "MoE" if module in ("gate_up", "down") else "attention"


def module_name(module: str) -> str:
    """``q`` → "q (attention)", ``gate_up`` → "gate_up (MoE)", ``shared_down`` → "shared_down (shared expert)",
    ``dense_up`` → "dense_up (dense MLP)"."""
    return f"{module} ({module_kind(module)})"


@dataclass
class ProbedStep:
    """One step of the probed request: the engine step index, its chunk kind and prefix, tokens, and per
    (layer, module) its output rows and (dense modules) its input rows (fp32, on the host)."""

    step: int
    kind: str
    prefix: int
    tokens: int
    rows: dict[tuple[int, str], torch.Tensor]
    inputs: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)


@dataclass
class Probe:
    """The module outputs of request ``target`` on ``engine`` (module doc). Install before serving."""

    engine: object
    target: str
    capacity: int
    buffers: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    inputs: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    steps: list[ProbedStep] = field(default_factory=list)

    def __post_init__(self) -> None:
        layer_of = {id(p): i for i, p in enumerate(self.engine.adapters.pools)}
        # every buffer allocated now, before any capture: a graph replays its copy into the tensor that
        # existed when it was captured
        model = self.engine.model
        c, dtype, device = model.config, model.dtype, model.device
        dense = {m: (out,) for m, (_, out) in c.dense_shapes.items()}
        # forward order: attention (q/k/v/o, or MLA's q_a/q_b/kv_a/kv_b/o), MoE, shared expert, dense MLP
        # (DeepSeek-V3's dense layers run it where the MoE block would be; their MoE buffers stay unwritten)
        attention = {m: dense.pop(m) for m in list(dense) if module_kind(m) == "attention"}
        shapes = {**attention, "gate_up": (c.top_k, 2 * c.moe_intermediate_size), "down": (c.top_k, c.hidden_size),
                  **dense}
        for layer in range(len(self.engine.adapters.pools)):
            for module, shape in shapes.items():
                self.buffers[(layer, module)] = torch.zeros(self.capacity, *shape, dtype=dtype, device=device)
            for module, (width, _) in c.dense_shapes.items():  # the inputs e4m3_crossing re-quantizes
                self.inputs[(layer, module)] = torch.zeros(self.capacity, width, dtype=dtype, device=device)
        backend = self.engine.runner.backend
        dense, gate_up, down = backend.dense_delta, backend.moe_gate_up_delta, backend.moe_down_delta

        def dense_delta(module, x, out, weights, info, *args, **kwargs):
            dense(module, x, out, weights, info, *args, **kwargs)
            self._keep((layer_of.get(id(weights), -1), module), out)
            self._keep((layer_of.get(id(weights), -1), module), x, self.inputs)

        def moe_gate_up_delta(x, topk_ids, out, weights, info, *args, **kwargs):
            gate_up(x, topk_ids, out, weights, info, *args, **kwargs)
            self._keep((layer_of.get(id(weights), -1), "gate_up"), out)

        def moe_down_delta(h, topk_ids, topk_weights, out, weights, info, *args, **kwargs):
            down(h, topk_ids, topk_weights, out, weights, info, *args, **kwargs)
            self._keep((layer_of.get(id(weights), -1), "down"), out)

        backend.dense_delta, backend.moe_gate_up_delta, backend.moe_down_delta = \
            dense_delta, moe_gate_up_delta, moe_down_delta

    def _keep(self, key: tuple[int, str], out: torch.Tensor,
              buffers: dict[tuple[int, str], torch.Tensor] | None = None) -> None:
        buf = (self.buffers if buffers is None else buffers).get(key)
        if buf is None or buf.shape[1:] != out.shape[1:] or buf.dtype != out.dtype:
            return  # a module or shape the model's config does not name: not probed
        buf[:out.shape[0]].copy_(out)

    def after_step(self, index: int, layout) -> None:
        """Read the target's rows of the step just run (``layout``: ``StepRecord.layout``)."""
        offset = 0
        for rid, _slot, n, prefix, kind in layout:
            if rid == self.target:
                rows = {k: b[offset:offset + n].to("cpu", torch.float32, copy=True) for k, b in self.buffers.items()}
                inputs = {k: b[offset:offset + n].to("cpu", torch.float32, copy=True) for k, b in self.inputs.items()}
                self.steps.append(ProbedStep(index, kind, prefix, n, rows, inputs))
            offset += n


def e4m3_crossing(layer_weights, module: str, x_got: torch.Tensor, x_want: torch.Tensor, out_got: torch.Tensor,
                  out_want: torch.Tensor, dtype: str) -> str | None:
    """Why the departing dense module ``module`` of a layer is an e4m3 midpoint crossing (module doc), or
    None when it is not one: not an fp8 projection (``layer_weights.dense_scales``); its unquantized
    inputs x [T, in] or their per-token-group scales (a group's amax rounds too) differ by more than
    the dtype's bound; their quantized values (``moelora_reference.fp8_block.quantize_activation``, the
    engine's base) differ at none or more than :data:`CROSSING_ELEMENTS` elements, or by more than one
    e4m3 step, or without straddling that step's midpoint; or the outputs [T, out] still depart once
    the crossing's base product (``fp8_linear`` of each input) is taken out."""
    from moelora_reference.fp8_block import fp8_linear, quantize_activation
    from moelora_reference.oracle import e4m3_ordinal

    scale_inv = getattr(layer_weights, "dense_scales", {}).get(module)
    if scale_inv is None or x_got.shape != x_want.shape or not x_want.numel():
        return None
    atol, rtol = BOUNDS.get(dtype, BOUNDS["bfloat16"])
    dx = float((x_got - x_want).abs().max())
    if not dx <= atol + rtol * float(x_want.abs().max()):
        return None
    block = layer_weights.weight_block
    (q_got, s_got), (q_want, s_want) = quantize_activation(x_got, block[1]), quantize_activation(x_want, block[1])
    where = (q_got != q_want).nonzero().tolist()
    if not bool(((s_got - s_want).abs() <= rtol * s_want).all()) or not 0 < len(where) <= CROSSING_ELEMENTS:
        return None
    steps = (e4m3_ordinal(q_got) - e4m3_ordinal(q_want)).abs()
    full_got, full_want = (s.repeat_interleave(block[1], dim=1)[:, :x_want.shape[1]] for s in (s_got, s_want))
    shown = []
    for t, j in where:
        # the quotients x / s as quantize_activation rounds them, either side of the two values' midpoint
        a, b = float(x_got[t, j] / full_got[t, j]), float(x_want[t, j] / full_want[t, j])
        mid = (float(q_got[t, j]) + float(q_want[t, j])) / 2
        if int(steps[t, j]) != 1 or (a - mid) * (b - mid) > 0:
            return None
        shown.append(f"token {t}, element {j}: x/s {a:.9g} vs {b:.9g} either side of the midpoint {mid:g}")
    w, bias = layer_weights.dense(module), layer_weights.bias(module)
    crossing = fp8_linear(x_got, w, scale_inv, block, bias).float() - \
        fp8_linear(x_want, w, scale_inv, block, bias).float()
    rest = float((out_got - out_want - crossing).abs().max())
    if not rest <= atol + rtol * float(out_want.abs().max()):
        return None
    return (f"an e4m3 crossing, not a fault: its unquantized inputs agree (max |Δ| {dx:.2g}) and its quantized inputs "
            f"differ by one e4m3 step at {len(where)} element{'s' * (len(where) > 1)} ({'; '.join(shown)}), "
            f"which accounts for the output's departure (max |Δ| {rest:.2g} without it)")


def first_departure(got: Probe, want: Probe, dtype: str) -> str | None:
    """The first step, layer and module where ``got``'s rows depart from ``want``'s (the reference), in
    the reference's call order, and why when it is an e4m3 crossing (:func:`e4m3_crossing`, the layer's
    weights read from ``want``'s engine); None when every probed row agrees."""
    atol, rtol = BOUNDS.get(dtype, BOUNDS["bfloat16"])
    order = list(want.buffers)  # layer by layer, each layer's modules in forward order (dense_shapes, MoE)
    for n, (g, w) in enumerate(zip(got.steps, want.steps)):
        if (g.prefix, g.tokens) != (w.prefix, w.tokens):
            return (f"its {n + 1}th step was scheduled differently (step {g.step}: {g.tokens} tokens at prefix "
                    f"{g.prefix}; the reference's: {w.tokens} at {w.prefix})")
        for key in order:
            a, b = g.rows.get(key), w.rows.get(key)
            if a is None or b is None or a.shape != b.shape:
                continue
            diff = float((a - b).abs().max()) if a.numel() else 0.0
            if not diff <= atol + rtol * float(b.abs().max() if b.numel() else 0.0):
                layer, module = key
                where = (f"step {g.step} ({g.kind}, {g.tokens} tokens at prefix {g.prefix}), layer {layer}, "
                         f"module {module_name(module)}: max |Δ| {diff:.3g}")
                x_got, x_want = g.inputs.get(key), w.inputs.get(key)
                why = None if x_got is None or x_want is None else \
                    e4m3_crossing(want.engine.model.layers[layer].w, module, x_got, x_want, a, b, dtype)
                return where if why is None else f"{where}: {why}"
    return None


def failing_request(message: str) -> str | None:
    """The first request id (``e2e-N``) a failure message names."""
    m = _REQUEST.search(message)
    return m.group(0) if m else None


def locate(message: str, *, workload, make_engine, reload_weights, reference: dict, mode: str, dtype: str,
           capacity: int) -> str | None:
    """Where the failure of ``message`` is (module doc): "first departs from the reference engine ..." or
    why it could not be placed; None when the message names no request.

    Args:
        workload: the served :class:`~.workload.Workload`. make_engine(backend_mode): a fresh engine of the
            backend under test (``"test"``) in ``mode`` or of the reference backend eagerly (``"reference"``).
        reload_weights: the workload's reload (tensors, config) or None. reference: ``Served.reference``.
        capacity: rows of each probe buffer (the largest step).
    """
    from moelora_conformance.e2e.workload import Workload, serve

    rid = failing_request(message)
    if rid is None:
        return None
    index = next((i for i, r in enumerate(workload.requests) if r["request_id"] == rid), None)
    if index is None:
        return None

    def probed(which: str, load: Workload, reloaded_first: bool) -> Probe:
        engine = make_engine(which)
        if reloaded_first:  # the request was served with the reloaded weights: the alone run too
            engine.load_adapter_from_tensors(workload.reload[1], *reload_weights)
        probe = Probe(engine, rid, capacity)
        serve(engine, load, reload_weights=reload_weights, probe=probe)
        return probe

    alone = Workload((workload.requests[index],), (0,), workload.seed)
    reloaded = rid in reference
    try:
        where = first_departure(probed("test", alone, reloaded), probed("reference", alone, reloaded), dtype)
        if where is not None:
            return f"{rid} alone ({mode}) first departs from the reference engine at {where}"
        where = first_departure(probed("test", workload, False), probed("reference", workload, False), dtype)
    except Exception as exc:  # the diagnosis never replaces the failure it explains
        return f"{rid}: no diagnosis ({type(exc).__name__}: {exc})"
    if where is not None:
        return f"{rid} in its batch ({mode}; alone it matches) first departs from the reference engine at {where}"
    return (f"{rid}: its LoRA module outputs match the reference engine's at every step, alone and in its batch "
            f"({mode}): the departure is outside the backend's LoRA calls (the reader, the pool, the engine)")
