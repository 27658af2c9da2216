"""Programmatic dependent launch (config key ``PDL``, read by every kernel of the fused MoE layer from its
op's table entry, ``moelora_kernels._common.PDL_OPS``; ``pdl_options``).

With 1, on sm_90 and newer, the kernel is launched with CUDA's programmatic dependent launch, and each
of its programs first waits for the stream's previous grid (``griddepcontrol.wait``) and then lets the
next one start (``_tiles.wait_for_producers``). The code after the wait is that of 0, so the results are
the same bit for bit; what can go wrong is order: a program that reads (or writes) before its producer has
finished, or a grid that completes before its predecessor (so the grid after it, waiting only on it, reads
early).

Covers: what ``pdl_options`` gives (an ordinary launch for CPU tensors and under the interpreter; refused
below compute capability 9.0 and on ROCm; PDL on 9.0, asked of the tensors' device); the key in the GPU
table lookup; invalid values refused before any write, at any batch size, by every launcher (both
alignments, the bf16 and fp8 base GEMMs (the fp8 one takes the bf16 GEMM's entries, this key included),
the fp8 activation quantization, the activation, the top-k sum, the MoE-LoRA shrink, expand and fused
kernel); each launcher hands its kernel exactly what ``pdl_options`` gives (asymmetric stand-ins); each
kernel's first statement is the wait, and the helper waits before it lets the next grid start (the
source); the whole layer against the fp64 oracle with PDL 1 on every op of the table (both delta paths);
every kernel compiles for sm_90 with the wait before any global access and any branch (every program
waits, early exits included), ``launch_dependents`` after it, and neither at 0. On an sm_90 GPU: each
launcher with PDL 1 right after a producer that lets it start at once, then writes the kernel's input late
(a control kernel that does not wait reads the stale input there, so the test can fail), equal to PDL 0
bit for bit; the layer with PDL 1 equal to PDL 0 bit for bit, eagerly and replayed from a CUDA graph over
fresh inputs.
"""

import ast
import importlib
import inspect
import json
import math
import re

import pytest
import torch
import triton
import triton.language as tl
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
    qwen3_fp8_gemm_case,
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
    table_copy_with,
)

from moelora_core import AlignOutput, KernelPreconditionError
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
from moelora_kernels._common import PDL, PDL_OPS, pdl_options
from moelora_kernels.fp8_block import fp8_moe_gemm, quantize_activation_fp8
from moelora_kernels.moe_epilogue import moe_activation, moe_sum

pytestmark = pytest.mark.interpreter

LAUNCHERS = ("lora_align", "lora_align_split", "base_align", "fused_moe_gemm", "quantize", "fp8_moe_gemm",
             "activation", "sum", "shrink", "expand", "fused")
_common = importlib.import_module("moelora_kernels._common")
moe_lora = importlib.import_module("moelora_kernels.moe_lora")
fused_moe_module = importlib.import_module("moelora_kernels.fused_moe")
fp8_module = importlib.import_module("moelora_kernels.fp8_block")
align_module = importlib.import_module("moelora_kernels.align")
epilogue_module = importlib.import_module("moelora_kernels.moe_epilogue")
#: (launcher module, kernel name) of each launcher (the alignments' first kernel runs only with ALIGN_SPLIT > 1)
KERNELS = {
    "lora_align": (align_module, "_moe_lora_align_block_size_kernel"),
    "lora_align_split": (align_module, "_moe_lora_align_count_kernel"),  # ALIGN_SPLIT 2: the block kernel too
    "base_align": (align_module, "_moe_lora_align_block_size_kernel"),
    "quantize": (fp8_module, "_quant_fp8_groups_kernel"),
    "activation": (epilogue_module, "_moe_activation_kernel"),
    "sum": (epilogue_module, "_moe_sum_kernel"),
    "fused_moe_gemm": (fused_moe_module, "_fused_moe_gemm_kernel"),
    "fp8_moe_gemm": (fp8_module, "_fp8_moe_gemm_kernel"),
    "shrink": (moe_lora, "_moe_lora_shrink_kernel"),
    "expand": (moe_lora, "_moe_lora_expand_kernel"),
    "fused": (moe_lora, "_fused_moe_lora_kernel"),
}
SM90 = ON_GPU and torch.cuda.get_device_capability()[0] >= 9


def _launched(which):
    """(module, kernel names) that one launch of ``which`` runs: its kernel (:data:`KERNELS`), and with
    ALIGN_SPLIT 2 the alignment's block kernel after its count kernel."""
    module, name = KERNELS[which]
    return module, [name, "_moe_lora_align_block_size_kernel"] if which == "lora_align_split" else [name]


# --- pdl_options ---------------------------------------------------------------------------------------


def test_options_on_the_cpu_are_an_ordinary_launch():
    assert pdl_options({"PDL": 1}, torch.device("cpu")) == {"PDL": False}
    assert pdl_options({"PDL": 0}, torch.device("cpu")) == {"PDL": False}


@pytest.mark.parametrize("capability, interpreting, want", [
    ((9, 0), False, {"PDL": True, "launch_pdl": True}),
    ((10, 0), False, {"PDL": True, "launch_pdl": True}),
    ((9, 0), True, {"PDL": False}),  # the interpreter has no inline PTX
])
def test_options_on_a_cuda_device(capability, interpreting, want, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(_common, "interpreting", lambda: interpreting)
    assert pdl_options({"PDL": 1}, torch.device("cuda", 0)) == want
    assert pdl_options({"PDL": 0}, torch.device("cuda", 0)) == {"PDL": False}


def test_options_ask_the_capability_of_the_tensors_device(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or (9, 0))
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    pdl_options({"PDL": 1}, torch.device("cuda", 1))
    assert asked == [torch.device("cuda", 1)]


def test_options_for_cpu_tensors_outside_the_interpreter_are_an_ordinary_launch(monkeypatch):
    def no_cuda(device=None):
        raise AssertionError("a CPU tensor's launch asked for a CUDA capability")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_cuda)
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    assert pdl_options({"PDL": 1}, torch.device("cpu")) == {"PDL": False}


def test_options_on_rocm_are_refused_by_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", "6.2")
    with pytest.raises(KernelPreconditionError, match="PDL: 1 needs CUDA"):
        pdl_options({"PDL": 1}, torch.device("cuda", 0))


@pytest.mark.parametrize("value", [0, 1])
def test_the_gpu_table_lookup_gives_the_key(value, monkeypatch, tmp_path):
    # on a GPU the launchers read the card's table over GPU_FALLBACK_CONFIG: the key set on every op, and
    # 0 where an entry does not set it
    path = tmp_path / "table.json"
    path.write_text(json.dumps({op: [{"PDL": value}] for op in PDL_OPS}))
    monkeypatch.setenv("MOELORA_KERNEL_CONFIGS", str(path))
    monkeypatch.setattr(configs, "interpreting", lambda: False)
    for op in PDL_OPS:
        assert configs.kernel_config(op, rows=8)["PDL"] == value, op
    assert configs.kernel_config("fp8_moe_gemm", rows=8, fallback_op="fused_moe_gemm")["PDL"] == value
    assert configs.kernel_config("dense_lora_shrink", rows=8)["PDL"] == 0


@pytest.mark.parametrize("capability", [(8, 0), (8, 9)])
def test_options_below_sm90_are_refused_by_name(capability, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    with pytest.raises(KernelPreconditionError, match=re.escape("PDL: 1 needs compute capability 9.0 or newer")):
        pdl_options({"PDL": 1}, torch.device("cuda", 0))
    assert pdl_options({"PDL": 0}, torch.device("cuda", 0)) == {"PDL": False}


# --- the launchers --------------------------------------------------------------------------------------


def _problem(which, M, seed=91):
    """One launch of ``which`` (a name of :data:`LAUNCHERS`) at M tokens, top_k 2, fresh inputs, its
    output poisoned: (``run(config)``, the output it writes, the input it reads that another kernel would
    have written: x, the intermediate, or the fp8 GEMM's quantized x)."""
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
    if which in ("lora_align", "lora_align_split", "base_align"):
        out_align = AlignOutput.empty(1 if which == "base_align" else 2, M, 2, spec.E, 32, device=DEVICE)
        for t_ in out_align:
            t_.fill_(-7)
        if which != "base_align":
            split = {"ALIGN_SPLIT": 2} if which == "lora_align_split" else {}
            return (lambda config: moe_lora_align_block_size(ids, mapping, spec.E, 32, 2, enabled, out=out_align,
                                                             config={**split, **config})), \
                out_align.sorted_token_ids, ids
        return (lambda config: moe_align_block_size(ids, spec.E, 32, out=out_align, config=config)), \
            out_align.sorted_token_ids, ids
    if which in ("activation", "sum"):
        if which == "activation":
            gate_up, h = randn(gen, 2 * M, 2 * spec.I, dtype=torch.float32), poisoned(2 * M, spec.I, dtype=torch.float32)
            return (lambda config: moe_activation(gate_up, topk_ids=ids, out=h, config=config)), h, gate_up
        down, y = randn(gen, M, 2, spec.H, dtype=torch.float32), poisoned(M, spec.H, dtype=torch.float32)
        return (lambda config: moe_sum(down, ids, out=y, config=config)), y, down
    if which == "quantize":
        held = poisoned(M, spec.H, dtype=torch.float32)  # the quantized x's bytes, copied in after the launch

        def quantize(config):
            q = quantize_activation_fp8(x, 8, config=config)[0].view(torch.uint8)
            held.view(torch.uint8)[:, :q.shape[1]].copy_(q)

        return quantize, held, x
    if which in ("fused_moe_gemm", "fp8_moe_gemm"):
        base_w = randn(gen, spec.E, 2 * spec.I, spec.H, dtype=torch.float32, scale=1 / math.sqrt(spec.H))
        c = poisoned(2 * M, 2 * spec.I, dtype=torch.float32)
        if which == "fused_moe_gemm":
            return (lambda config: fused_moe_gemm(x, base_w, c, base_align, top_k=2, num_pairs=2 * M, in_row_div=2,
                                                  config=config)), c, x
        # block 8 x 8 over H 40, 2I 48: one scale per block, drawn
        w8 = base_w.to(torch.float8_e4m3fn)
        scale_inv = randn(gen, spec.E, 6, 5, dtype=torch.float32).abs() + 0.5
        with launch_guard():
            q, s = quantize_activation_fp8(x, 8)
        return (lambda config: fp8_moe_gemm(q, s, w8, scale_inv, c, base_align, block=(8, 8), top_k=2,
                                            num_pairs=2 * M, in_row_div=2, config=config)), c, q
    if which == "shrink":
        inter = poisoned(2, 2 * M, 8, dtype=torch.float32)
        return (lambda config: fused_moe_lora_shrink(x, t["lora_a"], align, stage="gate_up", top_k=2,
                                                     ranks=t["ranks"], adapter_enabled=enabled, out=inter,
                                                     config=config)), inter, x
    if which == "expand":
        inter = randn(gen, 2, 2 * M, 8, dtype=torch.float32)
        return (lambda config: fused_moe_lora_expand(inter, t["lora_b"], align, out, stage="gate_up", top_k=2,
                                                     ranks=t["ranks"], scalings=t["scalings"],
                                                     adapter_enabled=enabled, config=config)), out, inter
    return (lambda config: fused_moe_lora(x, t["lora_a"], t["lora_b"], align, out, stage="gate_up", top_k=2,
                                          ranks=t["ranks"], scalings=t["scalings"], adapter_enabled=enabled,
                                          config=config)), out, x


@pytest.mark.parametrize("M", [6, 0])
@pytest.mark.parametrize("which", LAUNCHERS)
@pytest.mark.parametrize("bad", [2, -1, True, "1", None])
def test_an_invalid_value_is_refused_before_any_write(which, bad, M):
    # at any batch size, the empty one included (the config is checked before the empty-batch return)
    run, written, _ = _problem(which, M)
    before = written.clone()
    with pytest.raises(KernelPreconditionError, match=re.escape(f"PDL: must be one of {PDL}, got {bad!r}")):
        with launch_guard():
            run({"PDL": bad})
    assert_bitwise_equal(written, before, what=f"{which}'s output after PDL={bad!r} was refused")


@pytest.mark.parametrize("which", LAUNCHERS)
@pytest.mark.parametrize("given", [(True, True), (True, False), (False, True), (False, False)])
def test_the_launcher_hands_the_kernel_what_pdl_options_gives(which, given, monkeypatch):
    # pdl_options stood in for by asymmetric answers (any launcher that forwards other values, or drops
    # one, is caught on the CPU); the kernel then launches as an ordinary one under the interpreter
    module = KERNELS[which][0]
    asked = []

    def options(cfg, device):
        asked.append((cfg["PDL"], device.type))
        return {"PDL": given[0], "launch_pdl": given[1]}

    def record(args, kwargs):
        seen = (kwargs["PDL"], kwargs.pop("launch_pdl", False))
        kwargs["PDL"] = False
        return seen

    run, written, _ = _problem(which, 6)  # its set-up launches (alignments, quantization) as they are
    before = written.clone()
    monkeypatch.setattr(module, "pdl_options", options)
    module, names = _launched(which)
    spies = [LaunchSpy(getattr(module, n), record) for n in names]
    for n, spy in zip(names, spies):
        monkeypatch.setattr(module, n, spy)
    with launch_guard():
        run({"PDL": 1})
    assert asked == [(1, DEVICE.type)] and [spy.seen for spy in spies] == [[given]] * len(names)
    assert not torch.equal(written.cpu().view(torch.uint8), before.cpu().view(torch.uint8)), \
        f"{which}: the launch wrote nothing"


@pytest.mark.parametrize("which", LAUNCHERS)
def test_at_0_the_launch_is_the_one_before_the_key(which, monkeypatch):
    # no launch_pdl keyword reaches Triton at 0 (a backend whose options lack the field, ROCm's, would refuse it)
    run, _, _ = _problem(which, 6)
    module, names = _launched(which)
    spies = [LaunchSpy(getattr(module, n), lambda args, kwargs: ("launch_pdl" in kwargs, kwargs["PDL"]))
             for n in names]
    for n, spy in zip(names, spies):
        monkeypatch.setattr(module, n, spy)
    with launch_guard():
        run({"PDL": 0})
    assert [spy.seen for spy in spies] == [[(False, False)]] * len(names)


def test_each_kernel_waits_first():
    # the source: every kernel's first statement is the wait (before its program ids, loads and early
    # exits), once; the helper waits, then lets the next grid start
    for module, name in [*KERNELS.values(), (align_module, "_moe_lora_align_count_kernel")]:
        kernel_module = importlib.import_module(getattr(module, name).fn.__module__)
        tree = ast.parse(inspect.getsource(kernel_module))
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
        body = [n for n in fn.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        assert ast.unparse(body[0]) == "wait_for_producers(PDL)", f"{name}: first statement {ast.unparse(body[0])}"
        assert ast.unparse(fn).count("wait_for_producers(") == 1, name
    tiles = importlib.import_module("moelora_kernels._tiles")
    tree = ast.parse(inspect.getsource(tiles))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "wait_for_producers")
    body = [n for n in fn.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    assert [ast.unparse(n) for n in body] == ["if PDL:\n    gdc_wait()\n    gdc_launch_dependents()"]


@pytest.mark.parametrize("fused", [0, 1])
def test_layer_with_the_table_value_against_the_oracle(fused, monkeypatch, tmp_path):
    # PDL 1 on every entry of the four ops in the table the launchers read: the base GEMMs and the
    # deltas on either path, against the fp64 oracle
    check_layer_with_table(92, monkeypatch, tmp_path, keys={"PDL": 1}, ops=PDL_OPS, fused=fused,
                           what=f"PDL 1, FUSED {fused}")


# --- on an sm_90 GPU -------------------------------------------------------------------------------------


@triton.jit
def _late_writer(src_ptr, dst_ptr, n, spin, BLOCK: tl.constexpr):
    """dst[:n] = src[:n] (bytes), written after ``spin`` dependent steps; lets a grid launched after it with
    PDL start at once (``griddepcontrol.launch_dependents`` first), so that grid's programs run while this
    one still holds the old bytes."""
    tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(spin):  # converges to 2.0 exactly in fp32; the compiler cannot know it
        acc = acc * 0.5 + 1.0
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    v = tl.load(src_ptr + offs, mask=ok)
    tl.store(dst_ptr + offs, v + (acc - 2.0).to(tl.uint8), mask=ok)


@triton.jit
def _eager_copy(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """dst[:n] = src[:n] (bytes) with no wait: the control that reads whatever is there."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=ok), mask=ok)


#: Dependent steps of :func:`_late_writer`: about 0.1 s on an H100 / H200 (200 000 take about 1 ms), far
#: longer than a warm launcher's host time (tens of µs), so the kernel under test is launched while it runs.
SPIN = 20_000_000


def _write_late(good: torch.Tensor, dst: torch.Tensor, spin: int = SPIN) -> None:
    """Poison ``dst`` (NaN bytes 0xFF), then launch :func:`_late_writer` copying ``good``'s bytes into it."""
    src, out = good.view(torch.uint8).view(-1), dst.view(torch.uint8).view(-1)
    out.fill_(0xFF)
    _late_writer[(triton.cdiv(out.numel(), 1024),)](src, out, out.numel(), spin, BLOCK=1024)


@pytest.mark.skipif(not SM90, reason="programmatic dependent launch needs an sm_90 GPU")
@pytest.mark.parametrize("which", LAUNCHERS)
def test_a_kernel_reads_its_producers_writes(which):
    # the input the kernel reads is written late by a producer that lets the next grid start at once: with
    # PDL 1 the kernel waits for it (equal to PDL 0 bit for bit); a kernel that does not wait reads the
    # poison there (the control, so this test can fail). Every kernel is compiled and loaded first (a cold
    # compile outlasts the producer), and the launch must leave the host well before the producer ends.
    from time import perf_counter

    run, written, inp = _problem(which, 24)
    start, good = written.clone(), inp.clone()
    with launch_guard():
        run({"PDL": 0})
    torch.cuda.synchronize()
    want = written.clone()
    control = torch.empty_like(inp)
    c8 = control.view(torch.uint8).view(-1)

    def copy():
        _eager_copy[(triton.cdiv(c8.numel(), 1024),)](inp.view(torch.uint8).view(-1), c8, c8.numel(), BLOCK=1024,
                                                        launch_pdl=True)

    # warm-up: compile and load the producer, the control and the PDL variant; time the producer
    began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    began.record()
    _write_late(good, inp)
    ended.record()
    copy()
    with launch_guard():
        run({"PDL": 1})
    torch.cuda.synchronize()
    producer_ms = began.elapsed_time(ended)
    # the control: launched with PDL, no wait
    _write_late(good, inp)
    copy()
    torch.cuda.synchronize()
    assert not torch.equal(control.view(torch.uint8), good.view(torch.uint8)), \
        f"the control read the producer's writes ({producer_ms:.1f} ms): nothing here shows that the kernel waits"
    # the kernel under test
    written.copy_(start)
    _write_late(good, inp)
    t0 = perf_counter()
    with launch_guard():
        run({"PDL": 1})
    host_ms = (perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    assert host_ms < producer_ms / 2, f"{which}: launched {host_ms:.1f} ms after a {producer_ms:.1f} ms producer"
    assert_bitwise_equal(inp, good, what=f"{which}: the producer's output")
    if which.endswith(("_align", "_align_split")):  # the order of pairs in a block is the atomics' (free)
        written, want = (t.view(t.shape[0], -1, 32).sort(-1).values for t in (written, want))
    assert_bitwise_equal(written, want, what=f"{which} with PDL 1 after a late producer vs PDL 0")


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

    def table(value):  # this card's shipped table with PDL = value on every op of the layer
        return table_copy_with(configs.device_table_path(), tmp_path, keys={"PDL": value}, ops=PDL_OPS, fused=fused)

    def eager(value, inputs):
        monkeypatch.setenv("MOELORA_KERNEL_CONFIGS", table(value))
        with launch_guard():
            y = layer(*inputs)
        torch.cuda.synchronize()
        return y

    inputs = [draw(seed) for seed in (94, 95, 96)]
    want = [eager(0, i) for i in inputs]
    for i, (got, expected) in enumerate(zip([eager(1, i) for i in inputs], want)):
        assert_bitwise_equal(got, expected, what=f"eager PDL 1 vs 0, FUSED {fused}, draw {i}")
    static = [t.clone() for t in inputs[0]]
    monkeypatch.setenv("MOELORA_KERNEL_CONFIGS", table(1))
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
    """(name, kernel, case) of every kernel that takes ``PDL`` at Qwen3 shapes with it on, and the pair's shrink
    with it off."""
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
    out.append(("fp8_moe_gemm PDL True", "_fp8_block_kernels:_fp8_moe_gemm_kernel", qwen3_fp8_gemm_case(128, True,
                                                                                                         pdl=True)))
    quant = {"args": {"x_ptr": "bf16", "q_ptr": "fp8e4nv", "s_ptr": "fp32", "rows": 16384, "K": 2048, "eps": 1e-10,
                      "stride_xm": 2048, "stride_qm": 2048, "stride_sm": 16},
             "constexprs": {"GROUP": 128, "BLOCK": 128, "QUANT_ROWS": 16, "PDL": True}, "num_warps": 4, "num_stages": 1}
    out.append(("quantize PDL True", "_fp8_block_kernels:_quant_fp8_groups_kernel", quant))
    act = {"args": {"gate_up_ptr": "bf16", "h_ptr": "bf16", "topk_ids_ptr": "i32", "inter": 768, "alpha": 1.702,
                    "limit": 7.0, "stride_gm": 1536, "stride_hm": 768},
           "constexprs": {"BLOCK": 1024, "ACTIVATION": "silu", "GATED": True, "HAS_IDS": True, "PDL": True},
           "num_warps": 4, "num_stages": 1}
    out.append(("activation PDL True", "_moe_epilogue_kernels:_moe_activation_kernel", act))
    total = {"args": {"down_out_ptr": "bf16", "topk_ids_ptr": "i32", "y_ptr": "bf16", "hidden": 2048, "top_k": 8,
                      "stride_dm": 16384, "stride_dk": 2048, "stride_ym": 2048},
             "constexprs": {"BLOCK": 1024, "PDL": True}, "num_warps": 4, "num_stages": 1}
    out.append(("sum PDL True", "_moe_epilogue_kernels:_moe_sum_kernel", total))
    P = 1024 + 128 * 15 + 16  # capacity at M 128, top_k 8, E 128, BLOCK_M 16 (a multiple of 16)
    ptrs = ("topk_ids_ptr", "token_lora_mapping_ptr", "adapter_enabled_ptr", "sorted_token_ids_ptr", "expert_ids_ptr",
            "num_tokens_post_padded_ptr", "workspace_ptr")
    flags = {"E_PAD": 128, "BLOCK_PAIRS": 1024, "HAS_MAPPING": True, "HAS_ENABLED": True, "PDL": True}
    align = {"args": {p: "i32" for p in ptrs} | {"num_pairs": 1024, "top_k": 8, "num_experts": 128, "capacity": P,
                                                "num_blocks": P // 16, "pairs_per_part": 256, "stride_sorted": P,
                                                "stride_expert_ids": P // 16},
             "constexprs": {"BLOCK_M": 16, "SPLIT": 4, "BLOCK_ROWS": 64} | flags, "num_warps": 8, "num_stages": 1}
    out.append(("alignment PDL True", "_align_kernels:_moe_lora_align_block_size_kernel", align))
    count = {"args": {p: "i32" for p in ("topk_ids_ptr", "token_lora_mapping_ptr", "adapter_enabled_ptr",
                                         "workspace_ptr")} | {"num_pairs": 1024, "top_k": 8, "num_experts": 128,
                                                              "pairs_per_part": 256},
             "constexprs": {"SPLIT": 4} | flags, "num_warps": 4, "num_stages": 1}
    out.append(("alignment count PDL True", "_align_kernels:_moe_lora_align_count_kernel", count))
    return out


def test_the_kernels_compile_for_sm90_waiting_before_any_load_or_exit():
    results = []
    for name, kernel, case in _compile_cases():
        results.append((name, case, compile_for_h200(f"moelora_kernels.{kernel}", [case])[0]))
    for name, case, r in results:
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert r["shared"] <= H200_MAX_SHARED, f"{name}: shared memory {r['shared']} B"  # 0: element-wise
        first = r["ptx_first"]
        if case["constexprs"]["PDL"]:
            wait, launch = first["griddepcontrol.wait"], first["griddepcontrol.launch_dependents"]
            assert wait >= 0 and launch > wait, f"{name}: {first}"
            assert first["global_access"] > wait and first["branch"] > wait, f"{name}: the wait is not first: {first}"
        else:
            assert first["griddepcontrol.wait"] == first["griddepcontrol.launch_dependents"] == -1, f"{name}: {first}"
