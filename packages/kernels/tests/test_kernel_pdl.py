"""Programmatic dependent launch (config key ``PDL`` of ``fused_moe_gemm``, ``moe_lora_shrink``,
``moe_lora_expand`` and ``fused_moe_lora``; ``moelora_kernels._common.pdl_options``).

With 1, on sm_90 and newer, the kernel is launched with CUDA's programmatic dependent launch, and each
of its programs first waits for the stream's previous grid (``griddepcontrol.wait``) and then lets the
next one start (``_tiles.wait_for_producers``). The code after the wait is that of 0, so the results are
the same bit for bit; what can go wrong is order: a program that reads before its producer has finished,
or a grid that completes before its predecessor (so the grid after it, waiting only on it, reads early).

Covers: what ``pdl_options`` gives (an ordinary launch for CPU tensors and under the interpreter; refused
below compute capability 9.0; PDL on 9.0); invalid values refused before any write, at any batch size,
by all four launchers; each launcher hands its kernel what ``pdl_options`` gives; the whole layer against
the fp64 oracle with PDL 1 on every op of the table (both delta paths). On an sm_90 GPU: the layer with
PDL 1 equal to PDL 0 bit for bit, eagerly and replayed from a CUDA graph over fresh inputs (the graph keeps
the programmatic edges; a kernel reading before its producer finished gives other bits). The four kernels
compile for sm_90 with the wait before any global load and any branch (every program waits, early exits
included), ``launch_dependents`` after it, and neither at 0.
"""

import importlib
import json
import math
import re

import pytest
import torch
from kernel_testing import (
    DEVICE,
    H200_MAX_SHARED,
    ON_GPU,
    LaunchSpy,
    assert_bitwise_equal,
    compile_for_h200,
    launch_guard,
    poisoned,
    qwen3_base_args,
    randn,
)
from moe_lora_testing import (
    check_layer_with_table,
    enabled_of,
    make_pool,
    named_routing,
    qwen3_gate_up_args,
    qwen3_pair_args,
    stage_inputs,
)

from moelora_core import KernelPreconditionError
from moelora_kernels import (
    MoELoRAInputs,
    configs,
    fused_moe,
    fused_moe_gemm,
    fused_moe_lora,
    fused_moe_lora_expand,
    fused_moe_lora_shrink,
    moe_align_block_size,
    moe_block_m,
    moe_lora_align_block_size,
    stage_tensors,
)
from moelora_kernels._common import PDL, pdl_options

pytestmark = pytest.mark.interpreter

OPS = ("fused_moe_gemm", "moe_lora_shrink", "moe_lora_expand", "fused_moe_lora")
LAUNCHERS = ("fused_moe_gemm", "shrink", "expand", "fused")
_common = importlib.import_module("moelora_kernels._common")
moe_lora = importlib.import_module("moelora_kernels.moe_lora")
fused_moe_module = importlib.import_module("moelora_kernels.fused_moe")
SM90 = ON_GPU and torch.cuda.get_device_capability()[0] >= 9


# --- pdl_options ---------------------------------------------------------------------------------------


def test_options_on_the_cpu_are_an_ordinary_launch():
    assert pdl_options({"PDL": 1}, torch.device("cpu")) == {"PDL": False, "launch_pdl": False}
    assert pdl_options({"PDL": 0}, torch.device("cpu")) == {"PDL": False, "launch_pdl": False}


@pytest.mark.parametrize("capability, interpreting, want", [
    ((9, 0), False, {"PDL": True, "launch_pdl": True}),
    ((10, 0), False, {"PDL": True, "launch_pdl": True}),
    ((9, 0), True, {"PDL": False, "launch_pdl": False}),  # the interpreter has no inline PTX
])
def test_options_on_a_cuda_device(capability, interpreting, want, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(_common, "interpreting", lambda: interpreting)
    assert pdl_options({"PDL": 1}, torch.device("cuda", 0)) == want
    assert pdl_options({"PDL": 0}, torch.device("cuda", 0)) == {"PDL": False, "launch_pdl": False}


@pytest.mark.parametrize("capability", [(8, 0), (8, 9)])
def test_options_below_sm90_are_refused_by_name(capability, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    with pytest.raises(KernelPreconditionError, match=re.escape("PDL: 1 needs compute capability 9.0 or newer")):
        pdl_options({"PDL": 1}, torch.device("cuda", 0))
    assert pdl_options({"PDL": 0}, torch.device("cuda", 0)) == {"PDL": False, "launch_pdl": False}


# --- the launchers --------------------------------------------------------------------------------------


def _problem(which, M, seed=91):
    """One launch of ``which`` (a name of :data:`LAUNCHERS`) at M tokens, top_k 2, fresh inputs, its
    output poisoned: (``run(config)``, the output it writes)."""
    w = make_pool(seed, L=2, R=8)
    spec = w.spec
    empty = {"ids": torch.zeros(0, 2, dtype=torch.int32), "mapping": torch.zeros(0, dtype=torch.int32)} if M == 0 else {}
    gen, ids, mapping = named_routing(seed, spec, M, 2, **empty)
    enabled = enabled_of(mapping, 2)
    x, out, _ = stage_inputs(gen, "gate_up", M, 2, spec.H, spec.I, torch.float32, None)
    t = stage_tensors(w, "gate_up")
    with launch_guard():
        align = moe_lora_align_block_size(ids, mapping, spec.E, 32, 2, enabled)
        base_align = moe_align_block_size(ids, spec.E, 32)
    if which == "fused_moe_gemm":
        base_w = randn(gen, spec.E, 2 * spec.I, spec.H, dtype=torch.float32, scale=1 / math.sqrt(spec.H))
        c = poisoned(2 * M, 2 * spec.I, dtype=torch.float32)
        return (lambda config: fused_moe_gemm(x, base_w, c, base_align, top_k=2, num_pairs=2 * M, in_row_div=2,
                                              config=config)), c
    if which == "shrink":
        inter = poisoned(2, 2 * M, 8, dtype=torch.float32)
        return (lambda config: fused_moe_lora_shrink(x, t["lora_a"], align, stage="gate_up", top_k=2,
                                                     ranks=t["ranks"], adapter_enabled=enabled, out=inter,
                                                     config=config)), inter
    if which == "expand":
        inter = randn(gen, 2, 2 * M, 8, dtype=torch.float32)
        return (lambda config: fused_moe_lora_expand(inter, t["lora_b"], align, out, stage="gate_up", top_k=2,
                                                     ranks=t["ranks"], scalings=t["scalings"],
                                                     adapter_enabled=enabled, config=config)), out
    return (lambda config: fused_moe_lora(x, t["lora_a"], t["lora_b"], align, out, stage="gate_up", top_k=2,
                                          ranks=t["ranks"], scalings=t["scalings"], adapter_enabled=enabled,
                                          config=config)), out


@pytest.mark.parametrize("M", [6, 0])
@pytest.mark.parametrize("which", LAUNCHERS)
@pytest.mark.parametrize("bad", [2, -1, True, "1", None])
def test_an_invalid_value_is_refused_before_any_write(which, bad, M):
    # at any batch size, the empty one included (the config is checked before the empty-batch return)
    run, written = _problem(which, M)
    before = written.clone()
    with pytest.raises(KernelPreconditionError, match=re.escape(f"PDL: must be one of {PDL}, got {bad!r}")):
        with launch_guard():
            run({"PDL": bad})
    assert_bitwise_equal(written, before, what=f"{which}'s output after PDL={bad!r} was refused")


@pytest.mark.parametrize("which", LAUNCHERS)
@pytest.mark.parametrize("value", [0, 1])
def test_the_launcher_hands_the_kernel_what_pdl_options_gives(which, value, monkeypatch):
    module, name = {
        "fused_moe_gemm": (fused_moe_module, "_fused_moe_gemm_kernel"),
        "shrink": (moe_lora, "_moe_lora_shrink_kernel"),
        "expand": (moe_lora, "_moe_lora_expand_kernel"),
        "fused": (moe_lora, "_fused_moe_lora_kernel"),
    }[which]
    spy = LaunchSpy(getattr(module, name), lambda args, kwargs: (kwargs["PDL"], kwargs["launch_pdl"]))
    monkeypatch.setattr(module, name, spy)
    run, written = _problem(which, 6)
    before = written.clone()
    with launch_guard():
        run({"PDL": value})
    want = pdl_options({"PDL": value}, DEVICE)
    assert spy.seen == [(want["PDL"], want["launch_pdl"])]
    assert not torch.equal(written.cpu().view(torch.int32), before.cpu().view(torch.int32)), \
        f"{which}: the launch wrote nothing"


@pytest.mark.parametrize("fused", [0, 1])
def test_layer_with_the_table_value_against_the_oracle(fused, monkeypatch, tmp_path):
    # PDL 1 on every entry of the four ops in the table the launchers read: the base GEMMs and the
    # deltas on either path, against the fp64 oracle
    check_layer_with_table(92, monkeypatch, tmp_path, keys={"PDL": 1}, ops=OPS, fused=fused,
                           what=f"PDL 1, FUSED {fused}")


# --- on an sm_90 GPU -------------------------------------------------------------------------------------


def _table_with(tmp_path, value, fused):
    """A copy of this device's shipped table with ``PDL`` = ``value`` on every entry of :data:`OPS` and
    the delta path ``fused``; returns its path."""
    table = json.loads(open(configs.device_table_path()).read())
    for op in OPS:
        for entry in table.setdefault(op, [{}]):
            entry["PDL"] = value
    table["moe_lora_path"] = [{"FUSED": fused}]
    path = tmp_path / f"table-pdl{value}-fused{fused}.json"
    path.write_text(json.dumps(table))
    return str(path)


@pytest.mark.skipif(not SM90, reason="programmatic dependent launch needs an sm_90 GPU")
@pytest.mark.parametrize("fused", [0, 1])
def test_layer_in_a_cuda_graph_equals_the_ordinary_launches(fused, monkeypatch, tmp_path):
    # bf16, Qwen3-like widths scaled down, 4 slots of mixed ranks; the layer (base GEMMs + both stages'
    # deltas) eagerly with PDL 0 and 1, then captured with PDL 1 and replayed over fresh inputs: every
    # output equals PDL 0's bit for bit
    H, I, E, k, M = 512, 256, 16, 4, 96
    ranks = {0: {"gate": 16, "up": 16, "down": 16}, 1: {"gate": 8, "up": 4, "down": 16}, 2: {"gate": 16, "down": 2},
             3: {"gate": 1, "up": 16, "down": 9}}
    w = make_pool(93, L=4, E=E, H=H, I=I, R=16, dtype=torch.bfloat16, ranks=ranks, sigma=(0.5, 2.0, 1.0, 0.25))
    gen = torch.Generator().manual_seed(93)
    w_gu = randn(gen, E, 2 * I, H, dtype=torch.bfloat16, scale=1 / math.sqrt(H))
    w_d = randn(gen, E, H, I, dtype=torch.bfloat16, scale=1 / math.sqrt(I))

    def draw(seed):
        g = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(M)]).to(torch.int32)
        mapping = torch.randint(-1, 4, (M,), generator=g, dtype=torch.int32)
        return (randn(g, M, H, dtype=torch.bfloat16), ids.to(DEVICE),
                torch.softmax(torch.randn(M, k, generator=g), -1).to(DEVICE), mapping.to(DEVICE))

    def layer(x, ids, tw, mapping):
        align = moe_lora_align_block_size(ids, mapping, E, moe_block_m(M, k, E, 4), 4)
        return fused_moe(x, ids, tw, w_gu, w_d, deltas=MoELoRAInputs(w, align))

    def eager(value, inputs):
        monkeypatch.setenv("MOELORA_KERNEL_CONFIGS", _table_with(tmp_path, value, fused))
        with launch_guard():
            y = layer(*inputs)
        torch.cuda.synchronize()
        return y

    inputs = [draw(seed) for seed in (94, 95, 96)]
    want = [eager(0, i) for i in inputs]
    for i, (got, expected) in enumerate(zip([eager(1, i) for i in inputs], want)):
        assert_bitwise_equal(got, expected, what=f"eager PDL 1 vs 0, FUSED {fused}, draw {i}")
    static = [t.clone() for t in inputs[0]]
    monkeypatch.setenv("MOELORA_KERNEL_CONFIGS", _table_with(tmp_path, 1, fused))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(*static)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        y = layer(*static)
    for i in (1, 2, 0, 2):
        for dst, src in zip(static, inputs[i]):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(y, want[i], what=f"graph replay with PDL 1 vs eager PDL 0, FUSED {fused}, draw {i}")


# --- the sm_90 compile ------------------------------------------------------------------------------------


def _compile_cases():
    """(name, kernel, case) of the four kernels at Qwen3 tiles with PDL on, and the pair's shrink with it off."""
    out = []
    for pdl in (True, False):
        shrink = {"args": qwen3_pair_args("shrink", 16), "num_warps": 4, "num_stages": 4, "constexprs": {
            "BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_K": 128, "BLOCK_L": 4, "A_DESC": False, "HAS_ENABLED": True,
            "DOT_PRECISION": "tf32", "UPCAST": False, "PDL": pdl}}
        out.append((f"shrink PDL {pdl}", "_moe_lora_kernels:_moe_lora_shrink_kernel", shrink))
    expand = {"args": qwen3_pair_args("expand", 64), "num_warps": 4, "num_stages": 3, "constexprs": {
        "BLOCK_M": 16, "BLOCK_R": 64, "BLOCK_N": 128, "BLOCK_L": 4, "RANK_ALIGN": 8, "HAS_ENABLED": True,
        "MUL_ROUTED_WEIGHT": False, "DOT_PRECISION": "tf32", "UPCAST": False, "PDL": True}}
    out.append(("expand PDL True", "_moe_lora_kernels:_moe_lora_expand_kernel", expand))
    fused = {"args": qwen3_gate_up_args(16), "num_warps": 4, "num_stages": 3, "constexprs": {
        "BLOCK_M": 16, "BLOCK_R": 16, "BLOCK_K": 256, "BLOCK_N": 256, "N_SPLIT": 1, "BLOCK_L": 4, "EXPAND_LOADS": 1,
        "RANK_ALIGN": 8, "EXPAND_STAGES": 1, "A_DESC": False, "PDL": True, "HAS_ENABLED": True,
        "MUL_ROUTED_WEIGHT": False, "DOT_PRECISION": "tf32", "UPCAST": False}}
    out.append(("fused PDL True", "_moe_lora_kernels:_fused_moe_lora_kernel", fused))
    base = {"args": qwen3_base_args("gate_up") | {"w_ptr": "bf16"}, "num_warps": 4, "num_stages": 4, "constexprs": {
        "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "MUL_ROUTED_WEIGHT": False, "HAS_SCALE": False,
        "HAS_BIAS": False, "ADD_INTO": False, "DOT_PRECISION": "ieee", "UPCAST": False, "GROUP_SIZE_M": 8,
        "W_DESC": False, "PDL": True}}
    out.append(("fused_moe_gemm PDL True", "_fused_moe_kernels:_fused_moe_gemm_kernel", base))
    return out


def test_the_kernels_compile_for_sm90_waiting_before_any_load_or_exit():
    results = []
    for name, kernel, case in _compile_cases():
        results.append((name, case, compile_for_h200(f"moelora_kernels.{kernel}", [case])[0]))
    for name, case, r in results:
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert 0 < r["shared"] <= H200_MAX_SHARED, f"{name}: shared memory {r['shared']} B"
        first = r["ptx_first"]
        if case["constexprs"]["PDL"]:
            wait, launch = first["griddepcontrol.wait"], first["griddepcontrol.launch_dependents"]
            assert wait >= 0 and launch > wait, f"{name}: {first}"
            assert first["global_load"] > wait and first["branch"] > wait, f"{name}: the wait is not first: {first}"
        else:
            assert first["griddepcontrol.wait"] == first["griddepcontrol.launch_dependents"] == -1, f"{name}: {first}"
