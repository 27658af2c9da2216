"""Every peer path on the current backend protocol (conformance/docs/migration.md): one instance per
engine, one buffer set per graph family, a smaller bucket prepared over views of the family's
buffers, and its deltas equal to the oracle — eagerly and in that bucket.

Covers: ``check_protocol`` accepts each path; ``init_graph`` allocates the family once (a second
call with the same capacity keeps its buffers); a bucket's info reads the family's buffers (same
addresses) and carries ``private["family"]``; the MoE (base MoE in fp32, the path's gate_up delta
before the activation, its router-weighted down delta) and a dense delta of a mixed batch (adapter,
base and rank-0-slot requests, a sentinel expert id) equal ``moelora_reference.oracle`` under the
default tolerance policy; pad rows of the bucket get nothing; the SGLang paths declare fp32 off CUDA only and the legacy path
that its consumer never reads a disabled slot's alignment. Regression of the port from
``init_decode_graph`` / ``info.moe.*``.
"""

from __future__ import annotations

import pytest
import torch

from moelora_core import (
    DEFAULT_POLICY,
    BatchSpec,
    ForwardMode,
    LoRALayerSpec,
    LoRAWeights,
    ModuleLoRA,
    MoEBaseWeights,
    Request,
)
from moelora_core.backend import check_protocol, load_backend
from moelora_core.backend_checks import GraphCapacity
from moelora_core.moe_deltas import BackendMoEDeltas
from moelora_reference import base_moe
from moelora_reference.oracle import dense_lora_forward, moe_lora_forward

PATHS = ("moelora_peers.sglang:legacy", "moelora_peers.sglang:virtual_experts", "moelora_peers.sglang:grouped",
         "moelora_peers.vllm:fused")
H, I, E, K, L, R = 32, 16, 4, 2, 3, 8  # noqa: E741
F16, F32 = torch.float16, torch.float32


def _layer(seed: int = 0):
    spec = LoRALayerSpec(hidden_size=H, moe_intermediate_size=I, num_experts=E, top_k=K,
                         dense_shapes={"q": (H, 32)}, max_loras=L, max_rank=R, dtype=F16)
    gen = torch.Generator().manual_seed(seed)
    weights = LoRAWeights(spec)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    for slot, r, sigma in ((0, 8, 0.5), (2, 4, 2.0)):  # slot 1 stays empty (rank 0)
        adapter = {m: ModuleLoRA(rnd(E, r, fin), rnd(E, fout, r), sigma)
                   for m, (fin, fout) in (("gate", (H, I)), ("up", (H, I)), ("down", (I, H)))}
        adapter["q"] = ModuleLoRA(rnd(r, H), rnd(32, r), sigma)
        weights.load_slot(slot, adapter)
    base = MoEBaseWeights(w_gate_up=rnd(E, 2 * I, H).to(F16), w_down=rnd(E, H, I).to(F16), router=rnd(E, H))
    return spec, weights, base, gen


@pytest.mark.parametrize("target", PATHS, ids=lambda t: t.split(".")[-1])
def test_eager_and_a_smaller_bucket_equal_the_oracle_on_the_family_buffers(target: str) -> None:
    spec, weights, base, gen = _layer()
    backend = load_backend(target)(spec)
    check_protocol(backend)
    family = GraphCapacity.prefill(48, 8)
    backend.init_graph("prefill", family)
    buffers = {k: v.data_ptr() for k, v in backend.static_buffers("prefill").items()}
    backend.init_graph("prefill", family)  # allocated once
    assert {k: v.data_ptr() for k, v in backend.static_buffers("prefill").items()} == buffers
    reqs = [Request(0, 5), Request(-1, 3), Request(2, 1), Request(1, 2), Request(0, 1), Request(2, 7)]
    batch = BatchSpec(ForwardMode.EXTEND, reqs, L, weights.slot_ranks(), weights.slot_scalings())
    T = batch.num_tokens
    bucket = GraphCapacity.prefill(32, 6)
    mapping = torch.tensor(batch.token_lora_mapping, dtype=torch.int32)
    x = torch.randn(T, H, generator=gen).to(F16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32)
    ids[1, 0] = -1  # a sentinel expert id adds nothing
    w = torch.rand(T, K, generator=gen)
    want = moe_lora_forward(x, ids, w, base.w_gate_up, base.w_down, weights, mapping)
    xd = torch.randn(T, H, generator=gen).to(F16)
    want_q = dense_lora_forward(xd, None, "q", weights, mapping)
    for family_name in (None, "prefill"):
        info = backend.prepare(batch, family_name, bucket if family_name else None)
        assert info.private["family"] == family_name
        n = info.num_tokens  # the bucket's token capacity in graph mode: pad rows after the batch's
        assert n == (bucket.max_tokens if family_name else T)
        if family_name:
            assert info.token_lora_mapping.data_ptr() == buffers["token_lora_mapping"]
        pad = n - T
        xs = torch.cat([x, torch.randn(pad, H, generator=gen).to(F16)])
        ids_s = torch.cat([ids, torch.zeros(pad, K, dtype=torch.int32)])
        w_s = torch.cat([w, torch.rand(pad, K, generator=gen)])
        y = base_moe.moe_forward(xs, ids_s, w_s, base, deltas=BackendMoEDeltas(backend, weights, info), out_dtype=F32)
        DEFAULT_POLICY.assert_close(y[:T], want, dtype=F16, what=f"{target} MoE y ({family_name or 'eager'})")
        y_base = base_moe.moe_forward(xs[T:], ids_s[T:], w_s[T:], base, out_dtype=F32)
        torch.testing.assert_close(y[T:], y_base, rtol=0, atol=0)  # pad rows: no delta
        out = torch.zeros(n, 32, dtype=F16)
        backend.dense_delta("q", torch.cat([xd, torch.randn(pad, H, generator=gen).to(F16)]), out, weights, info)
        DEFAULT_POLICY.assert_close(out[:T], want_q, dtype=F16, what=f"{target} dense q ({family_name or 'eager'})")
        assert not out[T:].any()


@pytest.mark.parametrize(("path", "cuda", "cpu"), [
    # fp32 off CUDA only: the peers' tl.dot without input_precision is TF32 on NVIDIA, IEEE under the
    # interpreter; on CUDA the dtypes SGLang serves (its plan runner admits BF16 layers only)
    ("moelora_peers.sglang:legacy", {torch.float16, torch.bfloat16}, {F32, torch.float16, torch.bfloat16}),
    ("moelora_peers.sglang:grouped", {torch.bfloat16}, {F32, torch.float16, torch.bfloat16}),
    ("moelora_peers.sglang:virtual_experts", {torch.float16, torch.bfloat16}, {torch.float16, torch.bfloat16}),
])
def test_sglang_paths_declare_fp32_off_cuda_only(monkeypatch, path, cuda, cpu):
    from moelora_peers import sglang_grouped, sglang_hooks

    declared = {"legacy": lambda d: sglang_hooks.capabilities(False, d),
                "virtual_experts": lambda d: sglang_hooks.capabilities(True, d),
                "grouped": sglang_grouped.capabilities}[path.rpartition(":")[2]]
    assert set(declared("cuda").dtypes) == cuda and set(declared("cpu").dtypes) == cpu
    monkeypatch.setenv("MOELORA_PEERS_FP32_ON_CUDA", "1")  # the TF32 diagnostic's switch
    assert (F32 in declared("cuda").dtypes) is (F32 in cpu)
    monkeypatch.delenv("MOELORA_PEERS_FP32_ON_CUDA")
    spec = LoRALayerSpec(hidden_size=H, moe_intermediate_size=I, num_experts=E, top_k=K, dense_shapes={},
                         max_loras=L, max_rank=R, dtype=F16)  # on the CPU
    caps = load_backend(path)(spec).capabilities()  # the factory declares for its spec's device
    assert set(caps.dtypes) == cpu
    # SGLang's JIT align leaves a disabled slot's rows untouched and _fused_moe_lora_kernel never reads them
    assert caps.alignment_reads_disabled_slots is (not path.endswith(":legacy"))
