"""The delta calls of ``triton`` and ``csgmv`` on the kernels (under the interpreter), on hand-built
layers: the oracle per dtype, base rows untouched, each stage on its own call's routing.

Covers: a mixed batch (adapter, base and rank-0-slot requests; sentinel expert ids) through the
harness's MoE path (base MoE in fp32, the backend's gate_up delta before the activation and the
router-weighted down delta) equals ``moelora_reference.oracle`` in fp32 and fp16 (an fp16 pool adding
into fp32 intermediates), with and without virtual experts; dense
deltas equal the oracle; rows of tokens without an adapter stay bit for bit as they were (NaN
poison included); each stage aligns its own call (one alignment launch per stage, nothing kept
between calls), and layers with other pools sharing one routing buffer rewritten in place by a
Triton kernel each use their own routing (a regression test); non-floating
activations, router weights and outputs are refused before any launch or write; a
Triton launch inside the CPU
host-sync guard leaves its arguments device data (regression: the interpreter's storage copies
after a launch marked them as host data, and the suite's P08 failed on the next op on ``topk_ids``).
"""

import pytest
import torch
import triton
import triton.language as tl

from moelora_backends.csgmv_backend import CsgmvBackend
from moelora_backends.triton_backend import TritonBackend
from moelora_core import (
    DEFAULT_POLICY,
    BatchSpec,
    ForwardMode,
    InvalidFieldError,
    LoRALayerSpec,
    LoRAWeights,
    ModuleLoRA,
    MoEBaseWeights,
    Request,
)
from moelora_core.graphs import host_sync_guard
from moelora_core.graphs.triton_launches import intercept_triton_launches
from moelora_core.moe_deltas import BackendMoEDeltas
from moelora_kernels import moe_lora_align_block_size
from moelora_reference import base_moe
from moelora_reference.backend import ReferenceBackend
from moelora_reference.oracle import dense_lora_forward, moe_lora_forward

pytestmark = pytest.mark.interpreter
BACKENDS = {"triton": TritonBackend, "csgmv": CsgmvBackend}
H, I, E, K, L, R = 24, 16, 4, 2, 3, 8  # noqa: E741
F32 = torch.float32


def _layer(dtype, virtual, seed=0):
    spec = LoRALayerSpec(hidden_size=H, moe_intermediate_size=I, num_experts=E, top_k=K,
                         dense_shapes={"q": (H, 20), "o": (20, H)}, max_loras=L, max_rank=R, dtype=dtype,
                         virtual_experts=virtual)
    gen = torch.Generator().manual_seed(seed)
    weights = LoRAWeights(spec)
    rnd = lambda *shape: torch.randn(*shape, generator=gen) / shape[-1] ** 0.5
    for slot, r, sigma in ((0, 8, 0.5), (2, 3, 2.0)):  # slot 1 stays empty (rank 0)
        adapter = {m: ModuleLoRA(rnd(E, r, fin), rnd(E, fout, r), sigma)
                   for m, (fin, fout) in (("gate", (H, I)), ("up", (H, I)), ("down", (I, H)))}
        adapter["q"] = ModuleLoRA(rnd(r, H), rnd(20, r), sigma)
        if slot == 0:
            adapter["o"] = ModuleLoRA(rnd(r, 20), rnd(H, r), sigma)
        weights.load_slot(slot, adapter)
    base = MoEBaseWeights(w_gate_up=rnd(E, 2 * I, H).to(dtype), w_down=rnd(E, H, I).to(dtype), router=rnd(E, H))
    return spec, weights, base, gen


def _batch(weights):
    reqs = [Request(0, 5), Request(-1, 3), Request(2, 1), Request(1, 2), Request(0, 1), Request(2, 7)]
    return BatchSpec(ForwardMode.EXTEND, reqs, L, weights.slot_ranks(), weights.slot_scalings())


def _routing(T, gen):
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32)
    ids[1, 0] = -1  # a sentinel: not handled here
    return ids.contiguous(), torch.rand(T, K, generator=gen)


def _moe(backend, x, ids, w, weights, base, info):
    return base_moe.moe_forward(x, ids, w, base, deltas=BackendMoEDeltas(backend, weights, info), out_dtype=F32)


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("virtual", [False, True], ids=["standard", "virtual"])
def test_moe_and_dense_deltas_equal_the_oracle_and_leave_base_rows(name, dtype, virtual):
    spec, weights, base, gen = _layer(dtype, virtual)
    backend = BACKENDS[name](spec)
    batch = _batch(weights)
    T = batch.num_tokens
    x = torch.randn(T, H, generator=gen).to(dtype)
    ids, w = _routing(T, gen)
    info = backend.prepare(batch)
    mapping = torch.tensor(batch.token_lora_mapping, dtype=torch.int32)
    y = _moe(backend, x, ids, w, weights, base, info)
    want = moe_lora_forward(x, ids, w, base.w_gate_up, base.w_down, weights, mapping)
    DEFAULT_POLICY.assert_close(y, want, dtype=dtype, what=f"{name} MoE y")
    base_rows = mapping < 0
    y0 = _moe(backend, x, ids, w, weights, base, backend.prepare(BatchSpec(
        ForwardMode.EXTEND, [Request(-1, r.extend_len) for r in batch.requests], L, batch.lora_ranks, batch.scalings)))
    assert torch.equal(y[base_rows].view(torch.int32), y0[base_rows].view(torch.int32))
    for module, (fin, fout) in spec.dense_shapes.items():
        xd = torch.randn(T, fin, generator=gen).to(dtype)
        out = (xd.to(F32) @ torch.randn(fout, fin, generator=gen).T).to(dtype)
        out[base_rows] = float("nan")  # rows without an adapter must not be written
        before = out.clone()
        backend.dense_delta(module, xd, out, weights, info)
        delta = dense_lora_forward(xd, None, module, weights, mapping)
        lora_rows = ~base_rows  # out is rounded once to the dtype: compare the sums, not the differences
        DEFAULT_POLICY.assert_close(out[lora_rows], before[lora_rows].double() + delta[lora_rows], dtype=dtype,
                                    what=f"{name} dense {module}")
        assert torch.equal(out[base_rows].view(torch.int16 if dtype == torch.float16 else torch.int32),
                           before[base_rows].view(torch.int16 if dtype == torch.float16 else torch.int32))


@triton.jit
def _write_routing_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    """Stands for an engine's top-k routing kernel: writes a layer's routing into a static buffer
    (a Triton store bumps no autograd version counter)."""
    offs = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def _pool_of(weights, modules):
    """A pool with only ``modules`` of ``weights``'s slots (other modules absent: rank 0)."""
    pool = LoRAWeights(weights.spec)
    for slot in range(L):
        r = weights.host_ranks["gate"][slot]
        if r:
            pool.load_slot(slot, {m: ModuleLoRA(weights.factors(m)[0][slot, :, :r], weights.factors(m)[1][slot, ..., :r],
                                                float(weights.scalings(m)[slot])) for m in modules})
    return pool


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_layers_with_other_pools_and_one_rewritten_routing_buffer_each_use_their_own_routing(name):
    # Regression: the gate_up stage handed its alignment to the next down
    # call, keyed by the topk_ids object and its version. Layer 1 has only gate/up (its down stage
    # is skipped, the hand-off stayed), layer 2 only down (its gate_up stage is skipped), and the
    # engine rewrites one routing buffer with a Triton kernel: layer 2's down used layer 1's routing.
    spec, weights, base, gen = _layer(F32, False)
    backend = BACKENDS[name](spec)
    batch = _batch(weights)
    T = batch.num_tokens
    info = backend.prepare(batch)
    mapping = torch.tensor(batch.token_lora_mapping, dtype=torch.int32)
    layers = [_pool_of(weights, ("gate", "up")), _pool_of(weights, ("down",)), weights, _pool_of(weights, ("down",))]
    ids = torch.empty(T, K, dtype=torch.int32)  # the engine's static routing buffer
    for n, pool in enumerate(layers):
        routing, w = _routing(T, gen)
        _write_routing_kernel[(1,)](routing, ids, ids.numel(), BLOCK=triton.next_power_of_2(ids.numel()))
        x = torch.randn(T, H, generator=gen)
        y = _moe(backend, x, ids, w, pool, base, info)
        want = moe_lora_forward(x, routing, w, base.w_gate_up, base.w_down, pool, mapping)
        DEFAULT_POLICY.assert_close(y, want, dtype=F32, what=f"{name} layer {n} MoE y")


def _fp32_layer_inputs(name):
    """(spec, backend, pool, base, batch, info, x, topk_ids, topk_weights) of an fp32 layer."""
    spec, weights, base, gen = _layer(F32, False)
    backend = BACKENDS[name](spec)
    batch = _batch(weights)
    x = torch.randn(batch.num_tokens, H, generator=gen)
    ids, w = _routing(batch.num_tokens, gen)
    return spec, backend, weights, base, batch, backend.prepare(batch), x, ids, w


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_each_stage_aligns_its_own_call(name):
    # The backend keeps no alignment between delta calls: without align= a down stage with another
    # routing than its gate_up stage uses its own. A layer forward through BackendMoEDeltas aligns
    # once (shared_moe_alignment) and hands that alignment to both of its stages.
    spec, backend, weights, base, batch, info, x, ids, w = _fp32_layer_inputs(name)
    names = []

    def count(kernel, run, args, kwargs, grid):
        names.append(kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel))
        return run(kernel, *args, grid=grid, warmup=False, **kwargs)

    with intercept_triton_launches(count):
        _moe(backend, x, ids, w, weights, base, info)
        per_layer = sum("align" in n for n in names)
        gate_up_out = base_moe.gate_up(x, ids, base, out_dtype=F32)
        backend.moe_gate_up_delta(x, ids, gate_up_out, weights, info)
        other = ids.flip(0).contiguous()  # another routing for the down stage
        h = base_moe.activation(base_moe.gate_up(x, other, base, out_dtype=F32))
        down_out = base_moe.down(h, other, w, base)
        backend.moe_down_delta(h, other, w, down_out, weights, info)
    assert per_layer == 1
    assert sum("align" in n for n in names) == 3
    reference = ReferenceBackend(spec)
    want = base_moe.down(h, other, w, base)
    reference.moe_down_delta(h, other, w, want, weights, reference.prepare(batch))
    DEFAULT_POLICY.assert_close(down_out, want, dtype=F32, what=f"{name} down stage on its own routing")


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_a_shared_alignment_gives_the_same_layer_output_as_aligning_per_stage(name):
    _, backend, weights, base, _, info, x, ids, w = _fp32_layer_inputs(name)
    shared = _moe(backend, x, ids, w, weights, base, info)
    per_stage = BackendMoEDeltas(backend, weights, info)
    per_stage._shared = False  # each delta call aligns on its own
    assert torch.equal(shared, base_moe.moe_forward(x, ids, w, base, deltas=per_stage, out_dtype=F32))


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("kind", ["idle", "all-base"])
def test_a_layer_forward_of_a_batch_without_adapters_launches_no_lora_kernel(name, kind):
    # Regression (P09 on the built-in suite): the shared per-layer alignment was made for an eager
    # IDLE batch too, launching the alignment kernel where the delta calls launch nothing.
    spec, weights, base, gen = _layer(F32, False)
    backend = BACKENDS[name](spec)
    ranks, sigmas = weights.slot_ranks(), weights.slot_scalings()
    if kind == "idle":
        batch = BatchSpec(ForwardMode.IDLE, (), L, ranks, sigmas)
    else:
        batch = BatchSpec(ForwardMode.EXTEND, [Request(-1, 3), Request(-1, 2)], L, ranks, sigmas)
    T = batch.num_tokens
    x = torch.randn(T, H, generator=gen)
    ids, w = _routing(T, gen) if T else (torch.zeros(0, K, dtype=torch.int32), torch.zeros(0, K))
    info = backend.prepare(batch)
    names = []

    def count(kernel, run, args, kwargs, grid):
        names.append(kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel))
        return run(kernel, *args, grid=grid, warmup=False, **kwargs)

    with intercept_triton_launches(count):
        y = _moe(backend, x, ids, w, weights, base, info)
    assert names == []
    assert torch.equal(y, base_moe.moe_forward(x, ids, w, base, out_dtype=F32))


def test_a_triton_launch_inside_the_host_sync_guard_leaves_its_arguments_device_data():
    ids = torch.zeros(1, 1, dtype=torch.int32)  # the shrunk P08 case: T = 1, top_k = 1
    weight = torch.randn(4, 3)
    with host_sync_guard("cpu"):
        moe_lora_align_block_size(ids, torch.zeros(1, dtype=torch.int32), 4, 32, 1, torch.ones(1, dtype=torch.int32))
        picked = weight[ids.long()]  # device data indexed by device data: no host sync
    assert picked.shape == (1, 1, 3)


NON_FLOAT_ARGS = ("x", "gate_up_out", "h", "topk_weights", "down_out", "dense x", "dense out")


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("arg", NON_FLOAT_ARGS)
def test_non_floating_activations_and_outputs_are_refused_before_any_work(name, arg):
    # Regression: int32 x or out were accepted and the delta truncated.
    spec, weights, _, gen = _layer(F32, False)
    backend = BACKENDS[name](spec)
    batch = _batch(weights)
    T = batch.num_tokens
    info = backend.prepare(batch)
    ids, w = _routing(T, gen)
    args = {"x": torch.randn(T, H, generator=gen), "gate_up_out": torch.randn(T, K, 2 * I, generator=gen),
            "h": torch.randn(T * K, I, generator=gen), "topk_weights": w, "down_out": torch.randn(T, K, H, generator=gen),
            "dense x": torch.randn(T, H, generator=gen), "dense out": torch.randn(T, 20, generator=gen)}
    args[arg] = (args[arg] * 4).to(torch.int32)
    before = {k: v.clone() for k, v in args.items()}
    launches = []
    field = arg.removeprefix("dense ")
    with intercept_triton_launches(lambda kernel, run, a, kw, grid: launches.append(kernel)), \
            pytest.raises(InvalidFieldError, match=f"{field}: .*floating"):
        if arg in ("x", "gate_up_out"):
            backend.moe_gate_up_delta(args["x"], ids, args["gate_up_out"], weights, info)
        elif arg.startswith("dense"):
            backend.dense_delta("q", args["dense x"], args["dense out"], weights, info)
        else:
            backend.moe_down_delta(args["h"], ids, args["topk_weights"], args["down_out"], weights, info)
    assert not launches, "refused before any kernel launch"
    assert all(torch.equal(args[k], before[k]) for k in args), "refused before anything is written"
