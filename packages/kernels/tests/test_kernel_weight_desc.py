"""The base grouped GEMM's weight tiles through a TMA tensor descriptor (config key ``W_DESC`` of
``fused_moe_gemm``; ``fused_moe.weight_descriptor``).

With 1 a program reads its weight tiles [BLOCK_N, BLOCK_K] from a 2-D descriptor over the weight's rows
[E_w' · N, K] instead of masked pointer loads: a tile's columns past N are the next expert's rows (or the
descriptor's zero padding after the last expert) and are computed but never stored, and K past its end
reads zeros. The products are the pointer loads'; their order inside a dot of a transposed tile is the
dot's (the interpreter's fp32 matmul differs in the last bits), so results are judged against the twin
within tolerance.

Covers: drawn problems (fp32 and fp16, bf16 on a GPU; N and K that leave partial tiles, column tiles of
16 and 32, expert ids -1, router weights, a per-expert scale, adding into the output, 1-4 stored weights
read by 1-3 expert ids each) with the output poisoned: every computed pair equals the twin, rows of -1
pairs keep their poison, and a descriptor was made (the variant ran). Named: an output that is a column
slice of a wider poisoned buffer keeps every column past N poisoned (the next expert's rows never
stored); each layout a descriptor cannot describe (K not contiguous, two ways; a gap between two or three
experts; one weight expanded over the experts; a row stride or base address off 16 bytes) gets none,
a row stride past K with NaN padding gets one that stops at K, and every layout's GEMM equals the twin;
the descriptor's exact extent, strides and base; overlapping rows, row indices past int32 and empty
weights get none, as do blocks a descriptor cannot take (not powers of two, under 16 bytes, past 256);
``GROUP_SIZE_M`` 1, 2 and 8 with it; the launcher hands the kernel the descriptor (and the tensor at 0);
invalid values refused before any write; the whole layer against the fp64 oracle with the value set
through the config table; the kernel compiles for sm_90 at the Qwen3 shapes with the descriptor, reading
its weight tiles by TMA.
"""

import importlib
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from kernel_testing import (
    DEVICE,
    H200_MAX_SHARED,
    ON_GPU,
    LaunchSpy,
    assert_bitwise_equal,
    assert_close,
    compile_for_h200,
    launch_guard,
    poisoned,
    qwen3_base_args,
    randn,
)
from moe_lora_testing import check_layer_with_table

from moelora_core import KernelPreconditionError
from moelora_kernels import fused_moe_gemm, moe_align_block_size
from moelora_kernels.fused_moe import weight_descriptor
from moelora_reference import fused_moe as twin

pytestmark = pytest.mark.interpreter

#: bf16 only on a GPU (the interpreter computes bf16 wrongly).
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
F16 = torch.float16


def _gemm(x, w, out, align, k, *, w_desc, block_n=16, block_k=16, group_size_m=0, **kwargs):
    """``fused_moe_gemm`` of the gate_up kind (one row of ``x`` per token) with ``W_DESC`` = ``w_desc``."""
    config = {"W_DESC": w_desc, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_SIZE_M": group_size_m}
    with launch_guard():
        return fused_moe_gemm(x, w, out, align, top_k=k, num_pairs=x.shape[0] * k, in_row_div=k, config=config,
                              **kwargs)


def _routing(gen, M, k, E):
    """[M, k] int32 ids: distinct experts per token among E, every fifth token's last pair routed
    nowhere (-1)."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    ids[::5, -1] = -1
    return ids.to(DEVICE)


def _align(ids, E, block_m=16):
    with launch_guard():
        return moe_align_block_size(ids, E, block_m)


# --- drawn problems ----------------------------------------------------------------------------------


@st.composite
def problems(draw):
    return dict(
        seed=draw(st.integers(0, 2 ** 31 - 1), label="seed"),
        dtype=draw(st.sampled_from(DTYPES), label="dtype"),
        M=draw(st.integers(1, 40), label="M"),
        k=draw(st.integers(1, 2), label="k"),
        stored=draw(st.integers(1, 4), label="stored experts"),
        per_weight=draw(st.integers(1, 3), label="experts_per_weight"),
        N=draw(st.integers(1, 50), label="N"),
        K=8 * draw(st.integers(1, 7), label="K / 8"),  # a row of 16-byte multiples in fp16 and fp32
        block_n=draw(st.sampled_from([16, 32]), label="BLOCK_N"),
        block_k=draw(st.sampled_from([16, 32]), label="BLOCK_K"),
        routed=draw(st.booleans(), label="router weights"),
        scaled=draw(st.booleans(), label="scale"),
        add_into=draw(st.booleans(), label="add_into"),
    )


@given(p=problems())
def test_descriptor_path_matches_the_twin(p):
    gen = torch.Generator().manual_seed(p["seed"])
    M, N, K, dtype, epw = p["M"], p["N"], p["K"], p["dtype"], p["per_weight"]
    E = p["stored"] * epw  # expert ids; expert e reads stored weight e // experts_per_weight
    k = min(p["k"], E)
    w = randn(gen, p["stored"], N, K, dtype=dtype, scale=1 / math.sqrt(K))
    x = randn(gen, M, K, dtype=dtype)
    ids = _routing(gen, M, k, E)
    align = _align(ids, E)
    kwargs = {"experts_per_weight": epw}
    if p["routed"]:
        kwargs["topk_weights"] = torch.rand(M * k, generator=gen).to(DEVICE)
    if p["scaled"]:
        kwargs["scale"] = (torch.rand(E, generator=gen) + 0.5).to(DEVICE)
    assert weight_descriptor(w, p["block_n"], p["block_k"]) is not None, "no descriptor: the variant did not run"
    if p["add_into"]:
        start = randn(gen, M * k, N, dtype=dtype)
        start[(ids < 0).reshape(-1)] = float("nan")
    else:
        start = poisoned(M * k, N, dtype=dtype)
    out = _gemm(x, w, start.clone(), align, k, w_desc=1, block_n=p["block_n"], block_k=p["block_k"],
                add_into=p["add_into"], **kwargs)
    twin_kwargs = {key: v for key, v in kwargs.items() if key != "experts_per_weight"}
    want = twin.fused_moe_gemm(x, w.repeat_interleave(epw, 0), start.clone(), align, top_k=k, num_pairs=M * k,
                               in_row_div=k, add_into=p["add_into"], **twin_kwargs)  # the twin: one weight per expert
    here = (ids.reshape(-1) >= 0).cpu()
    assert bool(out.cpu()[~here].isnan().all()), "rows of pairs with no expert here were written"
    assert not bool(out.cpu()[here].isnan().any()), "a computed pair holds NaN: a tile was not computed"
    assert_close(out.cpu()[here], want.cpu()[here], dtype=dtype, what="W_DESC 1 vs twin", seed=p["seed"])


# --- named cases -------------------------------------------------------------------------------------


def test_columns_past_n_are_never_stored():
    """The descriptor tile's columns past N hold the next expert's rows (and, after the last expert, its
    zero padding): the output, a column slice of a wider NaN buffer, keeps every column past N poisoned."""
    gen = torch.Generator().manual_seed(31)
    M, k, E, N, K = 23, 2, 4, 20, 40  # N = 20: the second 16-wide tile reads 12 rows of the next expert
    w = randn(gen, E, N, K, dtype=torch.float32, scale=1 / math.sqrt(K))
    x = randn(gen, M, K, dtype=torch.float32)
    ids = _routing(gen, M, k, E)
    wide = poisoned(M * k, N + 13, dtype=torch.float32)
    out = _gemm(x, w, wide[:, :N], _align(ids, E), k, w_desc=1)
    assert bool(wide[:, N:].isnan().all()), "a column past N was stored"
    want = twin.fused_moe_gemm(x, w, poisoned(M * k, N, dtype=torch.float32), _align(ids, E), top_k=k,
                               num_pairs=M * k, in_row_div=k)
    here = (ids.reshape(-1) >= 0).cpu()
    assert_close(out.cpu()[here], want.cpu()[here], dtype=torch.float32, what="sliced output", seed=31)


def _layout(name):
    """A weight [E, N, K] laid out as ``name`` says, and whether a descriptor can describe it (each
    layout but the last two breaks one rule of ``weight_descriptor`` that no other rule covers)."""
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    E, N, K = 3, 24, 32

    def w(*shape):
        return randn(gen, *shape, dtype=F16, scale=0.2)

    if name == "K not contiguous, rows apart":  # stride(2) 2, stride(1) >= K, stride(0) = N stride(1)
        return w(E, N, 2 * K)[:, :, ::2], False
    if name == "K not contiguous, transposed":
        return w(E, K, N).transpose(1, 2), False
    if name == "a gap between two experts":
        return w(2, N + 8, K)[:, :N], False
    if name == "a gap between three experts":
        return w(E, N + 8, K)[:, :N], False
    if name == "one weight expanded over the experts":  # expert stride 0
        return w(1, N, K).expand(E, N, K), False
    if name == "row stride off 16 bytes":
        return w(E, N, K + 4)[:, :, :K], False
    if name == "base address off 16 bytes":
        return w(E * N * K + 8)[4:4 + E * N * K].view(E, N, K), False
    if name == "row padding past K (NaN)":  # describable: the descriptor's K stops before the padding
        padded = w(E, N, K + 8)
        padded[:, :, K:] = float("nan")
        return padded[:, :, :K], True
    assert name == "contiguous"
    return w(E, N, K), True


LAYOUTS = ["K not contiguous, rows apart", "K not contiguous, transposed", "a gap between two experts",
           "a gap between three experts", "one weight expanded over the experts", "row stride off 16 bytes",
           "base address off 16 bytes", "row padding past K (NaN)", "contiguous"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_layout_gets_a_descriptor_only_where_one_describes_it(name):
    """Every layout's GEMM with ``W_DESC`` 1 equals the twin, by descriptor where the layout allows one
    and by pointer loads elsewhere."""
    w, describable = _layout(name)
    assert (weight_descriptor(w, 16, 16) is not None) == describable, name
    gen = torch.Generator().manual_seed(32)
    E, N, K = w.shape
    M, k = 19, 2
    x = randn(gen, M, K, dtype=F16)
    ids = _routing(gen, M, k, E)
    out = _gemm(x, w, poisoned(M * k, N, dtype=F16), _align(ids, E), k, w_desc=1)
    want = twin.fused_moe_gemm(x, w, poisoned(M * k, N, dtype=F16), _align(ids, E), top_k=k, num_pairs=M * k,
                               in_row_div=k)
    here = (ids.reshape(-1) >= 0).cpu()
    assert_close(out.cpu()[here], want.cpu()[here], dtype=F16, what=name, seed=32)


def test_the_descriptor_covers_exactly_the_weights_rows():
    w, _ = _layout("row padding past K (NaN)")
    d = weight_descriptor(w, 32, 16)
    assert list(d.shape) == [3 * 24, 32] and list(d.strides) == [40, 1] and list(d.block_shape) == [32, 16]
    assert d.base.data_ptr() == w.data_ptr() and d.padding == "zero"


def test_shapes_no_descriptor_takes_get_none():
    base = torch.zeros(4096, dtype=F16, device=DEVICE)
    overlapping = base.as_strided((1, 24, 32), (24 * 8, 8, 1))  # rows 8 elements apart, 32 long
    assert weight_descriptor(overlapping, 16, 16) is None
    assert weight_descriptor(torch.empty(2 ** 12, 2 ** 19, 16, dtype=F16, device="meta"), 16, 16) is None  # 2^31 rows
    # the last box's rows past int32: rows + BLOCK_N reach 2^31
    assert weight_descriptor(torch.empty(1, 2 ** 31 - 64, 16, dtype=F16, device="meta"), 64, 16) is None
    assert weight_descriptor(torch.empty(1, 2 ** 31 - 65, 16, dtype=F16, device="meta"), 64, 16) is not None
    assert weight_descriptor(torch.zeros(1, 0, 32, dtype=F16, device=DEVICE), 16, 16) is None
    assert weight_descriptor(torch.zeros(1, 16, 0, dtype=F16, device=DEVICE), 16, 16) is None


@pytest.mark.parametrize("group", [1, 2, 8])
def test_descriptor_with_group_size_m(group):
    """The H100 table ships ``W_DESC`` 1 beside ``GROUP_SIZE_M`` 16: the renumbered column tile is the one
    the descriptor reads."""
    gen = torch.Generator().manual_seed(45)
    E, N, K, M, k = 4, 72, 48, 40, 2
    w = randn(gen, E, N, K, dtype=torch.float32, scale=1 / math.sqrt(K))
    x = randn(gen, M, K, dtype=torch.float32)
    ids = _routing(gen, M, k, E)
    out = _gemm(x, w, poisoned(M * k, N, dtype=torch.float32), _align(ids, E), k, w_desc=1, group_size_m=group)
    want = twin.fused_moe_gemm(x, w, poisoned(M * k, N, dtype=torch.float32), _align(ids, E), top_k=k,
                               num_pairs=M * k, in_row_div=k)
    here = (ids.reshape(-1) >= 0).cpu()
    assert_close(out.cpu()[here], want.cpu()[here], dtype=torch.float32, what=f"GROUP_SIZE_M {group}", seed=45)


@pytest.mark.parametrize("value, expect", [(1, ("TensorDescriptor", True)), (0, ("Tensor", False))])
def test_the_launcher_hands_the_kernel_the_descriptor(value, expect, monkeypatch):
    launcher = importlib.import_module("moelora_kernels.fused_moe")  # the module (the package exports the function)
    # the kernel's second argument is the weight: the descriptor, or the tensor at 0
    spy = LaunchSpy(launcher._fused_moe_gemm_kernel, lambda args, kwargs: (type(args[1]).__name__, kwargs["W_DESC"]))
    monkeypatch.setattr(launcher, "_fused_moe_gemm_kernel", spy)
    gen = torch.Generator().manual_seed(35)
    w = randn(gen, 3, 16, 32, dtype=torch.float32)
    x = randn(gen, 6, 32, dtype=torch.float32)
    ids = _routing(gen, 6, 2, 3)
    _gemm(x, w, poisoned(12, 16, dtype=torch.float32), _align(ids, 3), 2, w_desc=value)
    assert spy.seen == [expect]


def test_blocks_no_descriptor_takes_get_none():
    w = torch.zeros(2, 16, 256, dtype=torch.float16, device=DEVICE)
    assert weight_descriptor(w, 16, 16) is not None and weight_descriptor(w, 256, 256) is not None
    for block_n, block_k in ((24, 16), (16, 4), (512, 16), (16, 512)):  # not a power of two, 8 bytes, past 256
        assert weight_descriptor(w, block_n, block_k) is None, (block_n, block_k)


@pytest.mark.parametrize("value", [2, -1, True, 0.5, "1"])
def test_invalid_values_are_refused_before_any_write(value):
    gen = torch.Generator().manual_seed(33)
    w = randn(gen, 3, 16, 16, dtype=torch.float32)
    x = randn(gen, 5, 16, dtype=torch.float32)
    ids = _routing(gen, 5, 2, 3)
    out = poisoned(10, 16, dtype=torch.float32)
    before = out.clone()
    with pytest.raises(KernelPreconditionError, match="W_DESC"):
        _gemm(x, w, out, _align(ids, 3), 2, w_desc=value)
    assert_bitwise_equal(out, before, what=f"output after W_DESC={value!r} was refused")


@pytest.mark.parametrize("fused", [0, 1])
def test_layer_with_the_table_value_against_the_oracle(fused, monkeypatch, tmp_path):
    # W_DESC 1 on every base GEMM entry of the table the launcher reads: both base GEMMs of the layer
    # (gate_up and down) through the descriptor, the deltas on either path
    check_layer_with_table(34, monkeypatch, tmp_path, keys={"W_DESC": 1}, ops=["fused_moe_gemm"], fused=fused,
                           what=f"W_DESC 1, FUSED {fused}", H=48, I=32)


@pytest.mark.parametrize("stage", ["gate_up", "down"])
def test_compiles_for_sm90_with_the_descriptor(stage):
    """The kernel with ``W_DESC`` 1 compiles for the H200 at the tiles the peers ship for this layer from
    M 1024 (BLOCK_M 128, 256 × 64, 8 warps, 4 stages) and at a small-M tile, within the shared memory one
    block may take, reading its weight tiles by TMA (``cp.async.bulk.tensor.2d`` in the PTX)."""
    cases, names = [], []
    for block_m, block_n, block_k, warps, stages in ((128, 256, 64, 8, 4), (16, 128, 128, 4, 3)):
        args = qwen3_base_args(stage)
        args = {**args, "w_ptr": {"desc": "bf16", "block": [block_n, block_k]}}
        cases.append({"args": args, "num_warps": warps, "num_stages": stages, "constexprs": {
            "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "MUL_ROUTED_WEIGHT": stage == "down",
            "HAS_SCALE": False, "HAS_BIAS": False, "ADD_INTO": False, "DOT_PRECISION": "ieee", "UPCAST": False,
            "GROUP_SIZE_M": 0, "W_DESC": True, "PDL": False}})
        names.append(f"{stage} {block_m}; {block_n} x {block_k}")
    results = compile_for_h200("moelora_kernels._fused_moe_kernels:_fused_moe_gemm_kernel", cases)
    for name, r in zip(names, results, strict=True):
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert 0 <= r["shared"] <= H200_MAX_SHARED, f"{name}: shared memory {r['shared']} B"
        assert r["global_loads"].get("cp.async.bulk.tensor.2d", 0) >= 1, f"{name}: no TMA load: {r['global_loads']}"
