"""Small programs with a known graph fault, each with a clean twin, plus programs that exercise
the emulator's semantics (views, in-place, ``out=``, tuples, RNG, pinned copies, Triton).

Shared by the CPU tests (``test_graph_programs.py``) and the H200 agreement run
(``ci/gpu/graph_agreement.py``), so CUDA graphs and the emulator run exactly the same code.

Each program has static inputs (allocated once at capacity ``C``), a host-side ``load(state, b)``
that writes batch ``b`` (``b`` live rows) the way a backend's ``prepare`` would, and a
``forward(state)`` that is captured. :func:`run_program` loads the first size, captures, then for
every size loads and replays, and records three things per step:

- ``replay``: the graph's output;
- ``eager``: ``forward`` on a fresh state loaded with that batch only (what a correct engine
  returns);
- ``predicted`` (faulty programs): ``forward`` run eagerly with the fault's cause applied (the
  count frozen at the capture size, the captured buffer, the stale state), i.e. what a CUDA graph
  is predicted to return.

Data come from a CPU generator seeded by (seed, batch size), so every device sees the same values.
Elementwise ops, gathers and row sums only: their CUDA kernels are the same eager and in a graph,
so agreement can be checked bit for bit.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from moelora_core.errors import HostSyncError
from moelora_core.graphs import GraphPool, pin_host_memory

C = 8  # capacity (rows) of every static input
H = 4  # columns
S = 3  # adapter slots of the stale-tail programs
SIZES = (8, 3, 6, 1, 8)  # capture at SIZES[0]; replay every size in turn (small after large)

FAULTS = ("frozen_scalar", "reallocated_buffer", "stale_tail", "host_sync")


@dataclass(frozen=True)
class Program:
    """One program of the set.

    Attributes:
        name: stable id.
        fault: one of ``FAULTS``, or None for a clean program.
        twin: the name of the faulty/clean counterpart (None for semantics programs).
        build: (device, seed) -> state with the static inputs.
        load: (state, b) -> None; writes batch ``b`` into the static inputs (outside the graph).
        forward: (state) -> output tensor(s); the captured callable.
        predict: (state, capture_size) -> output; faulty programs only (see module docstring).
        note: what the fault is, for tables.
        needs_triton: only runs where Triton is installed.
    """

    name: str
    fault: str | None
    twin: str | None
    build: Callable[[torch.device, int], SimpleNamespace]
    load: Callable[[SimpleNamespace, int], None]
    forward: Callable[[SimpleNamespace], object]
    predict: Callable[[SimpleNamespace, int], object] | None = None
    note: str = ""
    needs_triton: bool = False


def batch_values(seed: int, b: int, *, cols: int = H) -> torch.Tensor:
    """[b, cols] fp32 values for batch ``b`` (CPU generator: identical on every device)."""
    gen = torch.Generator().manual_seed(seed * 1009 + b)
    return torch.randn(b, cols, generator=gen)


def batch_slots(seed: int, b: int) -> torch.Tensor:
    """[b] int32 adapter slots in [0, S) for batch ``b``."""
    gen = torch.Generator().manual_seed(seed * 2003 + b)
    return torch.randint(0, S, (b,), generator=gen, dtype=torch.int32)


def _base_state(device: torch.device, seed: int) -> SimpleNamespace:
    gen = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        device=device,
        seed=seed,
        x=torch.zeros(C, H, device=device),
        w=torch.randn(H, generator=gen).to(device),
        count=torch.zeros(1, dtype=torch.int32, device=device),
        n=0,
    )


def _load_rows(state: SimpleNamespace, b: int) -> None:
    """Static input rows: live head, zeroed tail (what a correct prepare writes)."""
    state.x[:b].copy_(batch_values(state.seed, b).to(state.device))
    state.x[b:].zero_()
    state.n = b
    state.count.fill_(b)


# -- frozen scalar: a Python int from the batch, frozen into the graph -----------------------
def _rows_affine(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    y = torch.zeros(C, H, device=x.device)
    y[:n] = x[:n] * w + 1.0
    return y


def _masked_affine(state: SimpleNamespace) -> torch.Tensor:
    live = torch.arange(C, device=state.device) < state.count
    return torch.where(live[:, None], state.x * state.w + 1.0, 0.0)


# -- reallocated buffer: prepare rebinds a new tensor instead of writing in place -------------
def _build_scaled(device: torch.device, seed: int) -> SimpleNamespace:
    state = _base_state(device, seed)
    state.scale = torch.zeros(C, device=device)
    state.captured_scale = None
    state.retired = []
    return state


def _scale_values(state: SimpleNamespace, b: int) -> torch.Tensor:
    values = torch.zeros(C)
    values[:b] = batch_values(state.seed + 7, b, cols=1).flatten()
    return values


def _load_rebinding(state: SimpleNamespace, b: int) -> None:
    _load_rows(state, b)
    # On CUDA a dropped buffer's block may be handed to a later allocation, and replay would
    # read whatever lands there; keeping it alive makes replay read the old values, which is
    # what the emulator always does (docs/graphs.md, known differences).
    state.retired.append(state.scale)
    state.scale = _scale_values(state, b).to(state.device)
    if state.captured_scale is None:
        state.captured_scale = state.scale


def _load_rewriting(state: SimpleNamespace, b: int) -> None:
    _load_rows(state, b)
    state.scale.copy_(_scale_values(state, b).to(state.device))


def _scaled(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * scale[:, None] + 1.0


# -- stale tail: prepare writes the live head of static metadata but not the tail -------------
def _build_mapped(device: torch.device, seed: int) -> SimpleNamespace:
    state = _base_state(device, seed)
    state.mapping = torch.full((C,), -1, dtype=torch.int32, device=device)
    state.table = (torch.arange(S, dtype=torch.float32) + 2.0).to(device)
    return state


def _load_head_only(state: SimpleNamespace, b: int) -> None:
    state.x[:b].copy_(batch_values(state.seed, b).to(state.device))
    state.mapping[:b].copy_(batch_slots(state.seed, b).to(state.device))


def _load_head_and_tail(state: SimpleNamespace, b: int) -> None:
    _load_head_only(state, b)
    state.x[b:].zero_()
    state.mapping[b:].fill_(-1)


def _mapped(state: SimpleNamespace) -> torch.Tensor:
    valid = state.mapping >= 0
    scale = state.table[state.mapping.clamp(min=0).long()]
    return torch.where(valid[:, None], state.x * scale[:, None], 0.0)


# -- host syncs: raise at capture on CUDA and on the emulator ---------------------------------
def _item_count(state: SimpleNamespace) -> torch.Tensor:
    n = int(state.count.item())
    return _rows_affine(state.x, state.w, n)


def _mask_rows(state: SimpleNamespace) -> torch.Tensor:
    live = torch.arange(C, device=state.device) < state.count
    picked = state.x[live] * state.w + 1.0  # x[mask]: a data-dependent shape
    y = torch.zeros(C, H, device=state.device)
    y[: picked.shape[0]] = picked
    return y


def _build_listed(device: torch.device, seed: int) -> SimpleNamespace:
    state = _base_state(device, seed)
    state.rows = torch.zeros(C, dtype=torch.int64, device=device)
    state.rows_host = pin_host_memory(torch.zeros(C, dtype=torch.int64))
    state.row_list = [0] * C
    return state


def _row_order(state: SimpleNamespace, b: int) -> list[int]:
    gen = torch.Generator().manual_seed(state.seed * 31 + b)
    return torch.randperm(C, generator=gen).tolist()


def _load_row_list(state: SimpleNamespace, b: int) -> None:
    _load_rows(state, b)
    state.row_list = _row_order(state, b)
    state.rows.copy_(torch.tensor(state.row_list, dtype=torch.int64).to(state.device))
    state.rows_host.copy_(torch.tensor(state.row_list, dtype=torch.int64))


def _rows_from_host_list(state: SimpleNamespace) -> torch.Tensor:
    rows = torch.tensor(state.row_list, dtype=torch.int64, device=state.device)  # blocking H2D copy
    return state.x.index_select(0, rows) * state.w


def _rows_from_static(state: SimpleNamespace) -> torch.Tensor:
    return state.x.index_select(0, state.rows) * state.w


def _rows_from_pinned(state: SimpleNamespace) -> torch.Tensor:
    # Captured as a copy that re-reads the pinned host buffer on every replay.
    state.rows.copy_(state.rows_host, non_blocking=True)
    return state.x.index_select(0, state.rows) * state.w


# -- frozen host tensor: a 0-dim host tensor made from a Python float during capture ----------
def _build_scalar(device: torch.device, seed: int) -> SimpleNamespace:
    state = _base_state(device, seed)
    state.gain = 1.0
    state.gain_dev = torch.zeros((), device=device)
    return state


def _load_gain(state: SimpleNamespace, b: int) -> None:
    _load_rows(state, b)
    state.gain = 0.5 + b / 4
    state.gain_dev.fill_(state.gain)


def _host_gain(state: SimpleNamespace, gain: float | None = None) -> torch.Tensor:
    g = torch.tensor(state.gain if gain is None else gain)  # host 0-dim: a scalar argument
    return state.x * g + state.w


def _device_gain(state: SimpleNamespace) -> torch.Tensor:
    return state.x * state.gain_dev + state.w


# -- semantics: views, in-place, out=, tuples, a pre-existing counter, RNG ---------------------
def _build_views(device: torch.device, seed: int) -> SimpleNamespace:
    state = _base_state(device, seed)
    state.out = torch.zeros(C, 2 * H, device=device)
    state.steps = torch.zeros(1, dtype=torch.int64, device=device)
    return state


def _views_forward(state: SimpleNamespace) -> tuple[torch.Tensor, ...]:
    left, right = state.out.split(H, dim=1)  # views of a static output
    torch.add(state.x, 1.0, out=left)  # out= into a view
    right.copy_(state.x.flip(1))
    vals, idx = torch.topk(state.x, 2, dim=1)  # tuple-returning op
    _, order = torch.sort(state.x[:, 0], stable=True)
    state.out[:, :2].add_(vals)  # in-place on a view
    state.out.view(C, 2, H)[:, 1].mul_(state.w)  # in-place through a reshaped view
    state.steps.add_(1)  # pre-existing state: incremented once per replay, not by capture
    first, *_ = state.x.unbind(1)
    return state.out, idx, order, first.cumsum(0)


def _rng_forward(state: SimpleNamespace) -> torch.Tensor:
    noise = torch.rand(C, H, device=state.device)
    return state.x + noise * state.w


# -- Triton: a launch with a device-side count, and one with a host count (frozen) ------------
def _triton_kernels():
    import graph_triton_kernels  # Triton is optional: imported only when a Triton program runs

    return graph_triton_kernels


def _triton_device_count(state: SimpleNamespace) -> torch.Tensor:
    out = torch.zeros(C, H, device=state.device)
    return _triton_kernels().add_rows(state.x, state.w.expand(C, H).contiguous(), out, count=state.count)


def _triton_host_count(state: SimpleNamespace, n: int | None = None) -> torch.Tensor:
    out = torch.zeros(C, H, device=state.device)
    return _triton_kernels().add_rows(state.x, state.w.expand(C, H).contiguous(), out,
                                      n_rows=state.n if n is None else n)


PROGRAMS: tuple[Program, ...] = (
    Program("frozen_scalar", "frozen_scalar", "device_count", _base_state, _load_rows,
            lambda s: _rows_affine(s.x, s.w, s.n), predict=lambda s, a: _rows_affine(s.x, s.w, a),
            note="x[:n] with n a Python int of the batch"),
    Program("device_count", None, "frozen_scalar", _base_state, _load_rows, _masked_affine,
            note="mask from a device count"),
    Program("frozen_host_tensor", "frozen_scalar", "device_scalar", _build_scalar, _load_gain, _host_gain,
            predict=lambda s, a: _host_gain(s, 0.5 + a / 4), note="torch.tensor(python float) in the graph"),
    Program("device_scalar", None, "frozen_host_tensor", _build_scalar, _load_gain, _device_gain,
            note="0-dim device tensor written by load"),
    Program("reallocated_buffer", "reallocated_buffer", "rewritten_buffer", _build_scaled, _load_rebinding,
            lambda s: _scaled(s.x, s.scale), predict=lambda s, a: _scaled(s.x, s.captured_scale),
            note="load rebinds state.scale to a new tensor"),
    Program("rewritten_buffer", None, "reallocated_buffer", _build_scaled, _load_rewriting,
            lambda s: _scaled(s.x, s.scale), note="load copies into state.scale"),
    Program("stale_tail", "stale_tail", "reset_tail", _build_mapped, _load_head_only, _mapped,
            predict=lambda s, a: _mapped(s), note="load writes the head of the mapping only"),
    Program("reset_tail", None, "stale_tail", _build_mapped, _load_head_and_tail, _mapped,
            note="load resets the tail to -1"),
    Program("host_sync_item", "host_sync", "device_count", _base_state, _load_rows, _item_count,
            note=".item() of a device count"),
    Program("host_sync_mask_index", "host_sync", "device_count", _base_state, _load_rows, _mask_rows,
            note="x[mask] (data-dependent shape)"),
    Program("host_sync_list_to_device", "host_sync", "static_rows", _build_listed, _load_row_list,
            _rows_from_host_list, note="torch.tensor(host list, device=...)"),
    Program("static_rows", None, "host_sync_list_to_device", _build_listed, _load_row_list, _rows_from_static,
            note="rows written into a static buffer by load"),
    Program("pinned_rows", None, None, _build_listed, _load_row_list, _rows_from_pinned,
            note="non_blocking copy from pinned host memory inside the graph"),
    Program("views_inplace_out", None, None, _build_views, _load_rows, _views_forward,
            note="views, in-place, out=, tuples, counter"),
    Program("rng", None, None, _base_state, _load_rows, _rng_forward, note="torch.rand, reseeded per step"),
    Program("triton_host_count", "frozen_scalar", "triton_device_count", _base_state, _load_rows,
            _triton_host_count, predict=lambda s, a: _triton_host_count(s, a),
            note="Triton grid and count from a host int", needs_triton=True),
    Program("triton_device_count", None, "triton_host_count", _base_state, _load_rows, _triton_device_count,
            note="Triton kernel reads the count on the device", needs_triton=True),
)
BY_NAME = {p.name: p for p in PROGRAMS}


def triton_available() -> bool:
    """Triton is installed (CPU runs must also have TRITON_INTERPRET=1 set)."""
    return importlib.util.find_spec("triton") is not None


@dataclass
class ProgramRun:
    """What one program did under one graph kind (tensors on the CPU)."""

    name: str
    kind: str
    error: BaseException | None = None
    replay: list[object] = field(default_factory=list)
    eager: list[object] = field(default_factory=list)
    predicted: list[object] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)


def _to_cpu(out: object) -> object:
    if isinstance(out, torch.Tensor):
        return out.detach().to("cpu", copy=True)
    return tuple(_to_cpu(o) for o in out)


def run_program(prog: Program, device: torch.device | str, kind: str | None, seed: int,
                sizes: tuple[int, ...] = SIZES) -> ProgramRun:
    """Load ``sizes[0]``, capture (one warm-up), then load and replay every size (see module docstring)."""
    device = torch.device(device)
    state = prog.build(device, seed)
    prog.load(state, sizes[0])
    pool = GraphPool("decode", device, kind=kind)
    run = ProgramRun(prog.name, pool.kind)
    torch.manual_seed(seed)
    try:
        graph = pool.capture(lambda: prog.forward(state), warmup=1)
    except HostSyncError as exc:
        run.error = exc
        return run
    for step, b in enumerate(sizes):
        prog.load(state, b)
        torch.manual_seed(seed + step)
        run.replay.append(_to_cpu(graph.replay()))
        if prog.predict is not None:
            torch.manual_seed(seed + step)
            run.predicted.append(_to_cpu(prog.predict(state, sizes[0])))
        fresh = prog.build(device, seed)
        prog.load(fresh, b)
        torch.manual_seed(seed + step)
        run.eager.append(_to_cpu(prog.forward(fresh)))
    run.state = {k: v.detach().cpu().clone() for k, v in vars(state).items() if isinstance(v, torch.Tensor)}
    return run


def same(a: object, b: object) -> bool:
    """Bitwise equality of outputs (tensors or tuples of tensors); NaN equals NaN."""
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype):
            return False
        if not a.is_floating_point():
            return bool(torch.equal(a, b))
        nan = torch.isnan(a)
        return bool(torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan]))
    return isinstance(b, tuple) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def check_run(prog: Program, run: ProgramRun) -> list[str]:
    """What is wrong with ``run`` against the program's prediction (empty list: as predicted).

    host_sync programs must fail capture with HostSyncError; clean programs must replay exactly
    as eager at every step; other faulty programs must replay exactly as predicted at every step
    and differ from eager at some step (the fault is visible).
    """
    if prog.fault == "host_sync":
        if not isinstance(run.error, HostSyncError):
            return [f"{prog.name}: expected HostSyncError at capture, got {run.error!r}"]
        return []
    if run.error is not None:
        return [f"{prog.name}: capture raised {run.error!r}"]
    problems = []
    if prog.fault is None:
        for step, (r, e) in enumerate(zip(run.replay, run.eager)):
            if not same(r, e):
                problems.append(f"{prog.name}: step {step}: replay differs from eager")
        return problems
    for step, (r, p) in enumerate(zip(run.replay, run.predicted)):
        if not same(r, p):
            problems.append(f"{prog.name}: step {step}: replay differs from the predicted faulty output")
    if all(same(r, e) for r, e in zip(run.replay, run.eager)):
        problems.append(f"{prog.name}: the fault never showed (replay equals eager at every step)")
    return problems
