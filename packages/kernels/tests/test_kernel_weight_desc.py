"""The base grouped GEMM's weight tiles through a TMA tensor descriptor (config key ``W_DESC`` of
``fused_moe_gemm``; ``fused_moe.weight_descriptor``).

With 1 a program reads its weight tiles [BLOCK_N, BLOCK_K] from a 2-D descriptor over the weight's rows
[E_w' · N, K] instead of masked pointer loads: a tile's columns past N are the next expert's rows (or the
descriptor's zero padding after the last expert) and are computed but never stored, and K past its end
reads zeros. The products are the pointer loads'; their order inside a dot of a transposed tile is the
dot's (the interpreter's fp32 matmul differs in the last bits), so results are judged against the twin
within tolerance.

Covers: drawn problems (fp32 and fp16, N and K that leave partial tiles, column tiles of 16 and 32,
expert ids -1, router weights, a per-expert scale, adding into
the output, a factor stored once per slot read by every expert) with the output poisoned: every computed
pair equals the twin, rows of -1 pairs keep their poison, and a descriptor was made (the variant ran).
Named: an output that is a column slice of a wider poisoned buffer keeps every column past N poisoned
(the next expert's rows never stored); the weights no descriptor can describe (K not contiguous, a gap
between experts, a row stride or base address off 16 bytes) get none and the GEMM still equals the twin,
as do blocks a descriptor cannot take (not powers of two, under 16 bytes, past 256); invalid values refused before any write; the whole layer against the fp64
oracle with the value set through the config table; the launcher hands the kernel the descriptor (and
the tensor at 0); the kernel compiles for sm_90 at the Qwen3 shapes
with the descriptor.
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
    assert_bitwise_equal,
    assert_close,
    compile_for_h200,
    launch_guard,
    poisoned,
    randn,
)
from moe_lora_testing import check_layer_with_table

from moelora_core import KernelPreconditionError
from moelora_kernels import fused_moe_gemm, moe_align_block_size
from moelora_kernels.fused_moe import weight_descriptor
from moelora_reference import fused_moe as twin

pytestmark = pytest.mark.interpreter


def _gemm(x, w, out, align, k, *, w_desc, block_n=16, block_k=16, **kwargs):
    """``fused_moe_gemm`` of the gate_up kind (one row of ``x`` per token) with ``W_DESC`` = ``w_desc``."""
    with launch_guard():
        return fused_moe_gemm(x, w, out, align, top_k=k, num_pairs=x.shape[0] * k, in_row_div=k,
                              config={"W_DESC": w_desc, "BLOCK_N": block_n, "BLOCK_K": block_k}, **kwargs)


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
        dtype=draw(st.sampled_from([torch.float32, torch.float16]), label="dtype"),
        M=draw(st.integers(1, 40), label="M"),
        k=draw(st.integers(1, 2), label="k"),
        E=draw(st.integers(2, 5), label="E"),
        N=draw(st.integers(1, 50), label="N"),
        K=8 * draw(st.integers(1, 7), label="K / 8"),  # a row of 16-byte multiples in fp16 and fp32
        block_n=draw(st.sampled_from([16, 32]), label="BLOCK_N"),
        block_k=draw(st.sampled_from([16, 32]), label="BLOCK_K"),
        routed=draw(st.booleans(), label="router weights"),
        scaled=draw(st.booleans(), label="scale"),
        add_into=draw(st.booleans(), label="add_into"),
        shared=draw(st.booleans(), label="one factor per slot (experts_per_weight = E)"),
    )


@given(p=problems())
def test_descriptor_path_matches_the_twin(p):
    gen = torch.Generator().manual_seed(p["seed"])
    M, k, E, N, K, dtype = p["M"], p["k"], p["E"], p["N"], p["K"], p["dtype"]
    epw = E if p["shared"] else 1
    w = randn(gen, 1 if p["shared"] else E, N, K, dtype=dtype, scale=1 / math.sqrt(K))
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
    want = twin.fused_moe_gemm(x, w.expand(E, N, K), start.clone(), align, top_k=k, num_pairs=M * k,
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


def _layouts(gen):
    """(name, weight, BLOCK_N, BLOCK_K) that no descriptor can describe: each breaks one rule of
    ``weight_descriptor``."""
    E, N, K = 3, 24, 32
    base = randn(gen, E, N, K, dtype=torch.float16, scale=0.2)
    wide_k = randn(gen, E, N, K + 8, dtype=torch.float16, scale=0.2)
    odd_k = randn(gen, E, N, K + 4, dtype=torch.float16, scale=0.2)
    flat = randn(gen, E * N * K + 8, dtype=torch.float16, scale=0.2)
    return [
        ("K not contiguous", base.transpose(1, 2).contiguous().transpose(1, 2), 16, 16),
        ("a gap between experts", randn(gen, E, N + 8, K, dtype=torch.float16, scale=0.2)[:, :N], 16, 16),
        ("row stride off 16 bytes", odd_k[:, :, :K], 16, 16),
        ("base address off 16 bytes", flat[4:4 + E * N * K].view(E, N, K), 16, 16),
        ("row stride past K is fine", wide_k[:, :, :K], 16, 16),
    ]


class _Spy:
    """Stands in for the launcher's kernel: records the weight argument and ``W_DESC`` of each launch,
    then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append((type(args[1]).__name__, kwargs["W_DESC"]))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("value, expect", [(1, ("TensorDescriptor", True)), (0, ("Tensor", False))])
def test_the_launcher_hands_the_kernel_the_descriptor(value, expect, monkeypatch):
    launcher = importlib.import_module("moelora_kernels.fused_moe")  # the module (the package exports the function)
    spy = _Spy(launcher._fused_moe_gemm_kernel)
    monkeypatch.setattr(launcher, "_fused_moe_gemm_kernel", spy)
    gen = torch.Generator().manual_seed(35)
    w = randn(gen, 3, 16, 32, dtype=torch.float32)
    x = randn(gen, 6, 32, dtype=torch.float32)
    ids = _routing(gen, 6, 2, 3)
    _gemm(x, w, poisoned(12, 16, dtype=torch.float32), _align(ids, 3), 2, w_desc=value)
    assert spy.seen == [expect]


def test_blocks_no_descriptor_takes_get_none():
    w = torch.zeros(2, 16, 32, dtype=torch.float16, device=DEVICE)
    assert weight_descriptor(w, 16, 16) is not None
    for block_n, block_k in ((24, 16), (16, 4), (512, 16), (16, 512)):  # not a power of two, 8 bytes, past 256
        assert weight_descriptor(w, block_n, block_k) is None, (block_n, block_k)


def test_weights_without_a_descriptor_take_the_pointer_loads():
    gen = torch.Generator().manual_seed(32)
    M, k, E = 19, 2, 3
    for name, w, block_n, block_k in _layouts(gen):
        expect = name == "row stride past K is fine"
        assert (weight_descriptor(w, block_n, block_k) is not None) == expect, name
        x = randn(gen, M, w.shape[2], dtype=torch.float16)
        ids = _routing(gen, M, k, E)
        out = _gemm(x, w, poisoned(M * k, w.shape[1], dtype=torch.float16), _align(ids, E), k, w_desc=1,
                    block_n=block_n, block_k=block_k)
        want = twin.fused_moe_gemm(x, w, poisoned(M * k, w.shape[1], dtype=torch.float16), _align(ids, E), top_k=k,
                                   num_pairs=M * k, in_row_div=k)
        here = (ids.reshape(-1) >= 0).cpu()
        assert_close(out.cpu()[here], want.cpu()[here], dtype=torch.float16, what=name, seed=32)


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


def _qwen3_base_args(stage, M=2048, E=128, H=2048, I=768):
    """``_fused_moe_gemm_kernel``'s runtime arguments at one Qwen3-30B-A3B base stage (bf16; the compile
    child's notation: element types for pointers, dicts for descriptors, ints for sizes)."""
    N, K = (2 * I, H) if stage == "gate_up" else (H, I)
    k = 8
    pairs = M * k
    return {
        "a_ptr": "bf16", "c_ptr": "bf16", "sorted_token_ids_ptr": "i32", "expert_ids_ptr": "i32",
        "num_tokens_post_padded_ptr": "i32", "topk_weights_ptr": "fp32", "scale_ptr": "i32", "bias_ptr": "i32",
        "N": N, "K": K, "num_pairs": pairs, "in_row_div": k if stage == "gate_up" else 1,
        "experts_per_scale": 1, "experts_per_weight": 1, "num_experts": E,
        "stride_am": K, "stride_ak": 1, "stride_we": N * K, "stride_wn": K, "stride_wk": 1,
        "stride_cm": N, "stride_cn": 1, "stride_bias_e": 0, "stride_bias_n": 0,
    }


@pytest.mark.parametrize("stage", ["gate_up", "down"])
def test_compiles_for_sm90_with_the_descriptor(stage):
    """The kernel with ``W_DESC`` 1 compiles for the H200 at the tiles the peers ship for this layer from
    M 1024 (BLOCK_M 128, 256 × 64, 8 warps, 4 stages) and at a small-M tile, within the shared memory one
    block may take, reading its weight tiles by TMA (``cp.async.bulk.tensor.2d`` in the PTX)."""
    cases, names = [], []
    for block_m, block_n, block_k, warps, stages in ((128, 256, 64, 8, 4), (16, 128, 128, 4, 3)):
        args = _qwen3_base_args(stage)
        args = {**args, "w_ptr": {"desc": "bf16", "block": [block_n, block_k]}}
        cases.append({"args": args, "num_warps": warps, "num_stages": stages, "constexprs": {
            "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "MUL_ROUTED_WEIGHT": stage == "down",
            "HAS_SCALE": False, "HAS_BIAS": False, "ADD_INTO": False, "DOT_PRECISION": "ieee", "UPCAST": False,
            "GROUP_SIZE_M": 0, "W_DESC": True}})
        names.append(f"{stage} {block_m}; {block_n} x {block_k}")
    results = compile_for_h200("moelora_kernels._fused_moe_kernels:_fused_moe_gemm_kernel", cases)
    for name, r in zip(names, results, strict=True):
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert 0 <= r["shared"] <= H200_MAX_SHARED, f"{name}: shared memory {r['shared']} B"
        assert r["global_loads"].get("cp.async.bulk.tensor.2d", 0) >= 1, f"{name}: no TMA load: {r['global_loads']}"
