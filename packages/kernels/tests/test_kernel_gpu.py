"""GPU-only kernel checks (skipped without CUDA).

Covers: element offsets past 2^31 (the base GEMM and the fused MoE-LoRA delta writing rows of a
[M, top_k, 2I] output with more than 2^31 elements); every launcher captured once in a
``torch.cuda.CUDAGraph`` and replayed with different batches of the same capacity (a large batch,
then a small one, then an IDLE one on the same static buffers), each replay equal to an eager run
bit for bit; all of it under ``torch.cuda.set_sync_debug_mode("error")`` (``launch_guard``).

The rest of the kernel suite runs on the GPU as it is, with bf16 among the drawn dtypes and, in the
``gpu`` profile, Qwen3-30B-A3B layer shapes (H 2048, I 768, E 128, top-8) among the drawn shapes.
"""

import math

import pytest
import torch
from kernel_testing import ON_GPU, assert_bitwise_equal, assert_close, launch_guard
from moe_lora_testing import make_pool

from moelora_core import NO_ADAPTER, AlignOutput
from moelora_kernels import (
    MoELoRAInputs,
    chunked_sgmv_expand,
    chunked_sgmv_shrink,
    fused_moe,
    fused_moe_gemm,
    moe_align_block_size,
    moe_lora_align_block_size,
    moe_lora_delta,
    segmented_lora_a,
    segmented_lora_b,
    stage_tensors,
    token_lora_mapping,
    virtual_align,
    virtual_moe_lora_delta,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs CUDA")]


def test_offsets_past_2_31_elements():
    # gate_up_out [M, 8, 2I] with M·8·2I > 2^31: the LoRA delta lands in the last rows
    dev = torch.device("cuda")
    M, k, I, H, E = 140_000, 8, 1024, 64, 8
    assert M * k * 2 * I > 2**31
    w = make_pool(50, L=2, E=E, H=H, I=I, R=16, dtype=torch.bfloat16)
    gen = torch.Generator(dev).manual_seed(50)
    x = torch.randn(M, H, generator=gen, device=dev).to(torch.bfloat16)
    ids = torch.randint(0, E, (M, k), generator=gen, device=dev, dtype=torch.int32)
    mapping = torch.full((M,), NO_ADAPTER, dtype=torch.int32, device=dev)
    mapping[-37:] = 1
    mapping[-80:-60] = 0
    out = torch.zeros(M, k, 2 * I, dtype=torch.bfloat16, device=dev)
    with launch_guard():
        align = moe_lora_align_block_size(ids, mapping, E, 16, 2)
        moe_lora_delta("gate_up", x, out, w, align, top_k=k)
    rows = torch.arange(M - 80, M, device=dev)
    t = stage_tensors(w, "gate_up")
    slots = mapping[rows].long()
    for s in range(2):
        A = t["lora_a"][s][slots.clamp(min=0)[:, None], ids[rows].long()].float()  # [n, k, R, H]
        B = t["lora_b"][s][slots.clamp(min=0)[:, None], ids[rows].long()].float()  # [n, k, I, R]
        sigma = t["scalings"][s][slots.clamp(min=0)]
        shrink = torch.einsum("nkrh,nh->nkr", A, x[rows].float()).to(torch.bfloat16).float()
        delta = torch.einsum("nkir,nkr->nki", B, shrink) * sigma[:, None, None]
        delta[slots < 0] = 0
        assert_close(out[rows, :, s * I:(s + 1) * I], delta.to(torch.bfloat16), dtype=torch.bfloat16,
                     what=f"slice {s} past 2^31")
    assert bool((out[: M - 80] == 0).all()), "rows of base tokens changed"

    # the base GEMM into the same > 2^31-element buffer
    w_gu = (torch.randn(E, 2 * I, H, generator=gen, device=dev) / math.sqrt(H)).to(torch.bfloat16)
    with launch_guard():
        base_align = moe_align_block_size(ids, E, 64)
        fused_moe_gemm(x, w_gu, out.view(M * k, 2 * I), base_align, top_k=k, num_pairs=M * k, in_row_div=k)
    last = torch.arange(M - 5, M, device=dev)
    want = torch.einsum("nkoh,nh->nko", w_gu[ids[last].long()].float(), x[last].float())
    assert_close(out[last], want.to(torch.bfloat16), dtype=torch.bfloat16, what="base GEMM past 2^31")


class _Layer:
    """Static buffers of one MoE-LoRA layer step at fixed capacity, and the whole step as one callable."""

    def __init__(self, M_cap=96, bs_cap=12, k=8, E=16, L=4, H=256, I=128, R=16, dtype=torch.bfloat16):
        dev = torch.device("cuda")
        self.M_cap, self.bs_cap, self.k, self.E, self.L, self.H, self.I = M_cap, bs_cap, k, E, L, H, I
        gen = torch.Generator(dev).manual_seed(60)
        self.w = make_pool(60, L=L, E=E, H=H, I=I, R=R, dtype=dtype)
        self.w_gu = (torch.randn(E, 2 * I, H, generator=gen, device=dev) / math.sqrt(H)).to(dtype)
        self.w_d = (torch.randn(E, H, I, generator=gen, device=dev) / math.sqrt(I)).to(dtype)
        self.q_A = (torch.randn(L, R, H, generator=gen, device=dev) / math.sqrt(H)).to(dtype)
        self.q_B = (torch.randn(L, H, R, generator=gen, device=dev) / math.sqrt(R)).to(dtype)
        self.q_ranks = torch.tensor([R, R // 2, 0, 3], dtype=torch.int32, device=dev)[:L]
        self.q_scalings = torch.tensor([0.5, 1.0, 0.0, 2.0], device=dev)[:L]
        # static inputs
        self.x = torch.zeros(M_cap, H, dtype=dtype, device=dev)
        self.ids = torch.zeros(M_cap, k, dtype=torch.int32, device=dev)
        self.tw = torch.zeros(M_cap, k, device=dev)
        self.seg_indptr = torch.zeros(bs_cap + 1, dtype=torch.int32, device=dev)
        self.req_weight_indices = torch.full((bs_cap,), -1, dtype=torch.int32, device=dev)
        self.perm = torch.arange(M_cap, device=dev)
        self.chunk_indptr = torch.zeros(M_cap + L + 2, dtype=torch.int32, device=dev)
        self.chunk_slots = torch.full((M_cap + L + 1,), -1, dtype=torch.int32, device=dev)
        # static metadata written by kernels
        self.mapping = torch.full((M_cap,), -1, dtype=torch.int32, device=dev)
        self.enabled = torch.zeros(L, dtype=torch.int32, device=dev)
        self.align = AlignOutput.empty(L, M_cap, k, E, 16, dev)
        self.base_align = AlignOutput.empty(1, M_cap, k, E, 16, dev)
        self.valign = AlignOutput.empty(1, M_cap, k, E * L, 16, dev)

    def step(self):
        """Everything a layer runs: mapping, alignments, base MoE + fused deltas, unfused and virtual
        deltas, dense segmented and chunked deltas."""
        token_lora_mapping(self.seg_indptr, self.req_weight_indices, max_loras=self.L, mapping_out=self.mapping,
                           adapter_enabled_out=self.enabled)
        moe_lora_align_block_size(self.ids, self.mapping, self.E, 16, self.L, self.enabled, out=self.align)
        moe_align_block_size(self.ids, self.E, 16, out=self.base_align)
        y = fused_moe(self.x, self.ids, self.tw, self.w_gu, self.w_d, align=self.base_align,
                      deltas=MoELoRAInputs(self.w, self.align, self.enabled))
        gate_up = torch.zeros(self.M_cap, self.k, 2 * self.I, dtype=self.x.dtype, device=self.x.device)
        moe_lora_delta("gate_up", self.x, gate_up, self.w, self.align, top_k=self.k, adapter_enabled=self.enabled,
                       fused=False)
        _, valign = virtual_align(self.ids, self.mapping, self.E, self.L, block_m=16, out=self.valign)
        virtual = torch.zeros_like(gate_up)
        virtual_moe_lora_delta("gate_up", self.x, virtual, self.w, valign, top_k=self.k)
        dense = torch.zeros(self.M_cap, self.H, dtype=self.x.dtype, device=self.x.device)
        t = segmented_lora_a(self.x, self.q_A, self.seg_indptr, self.req_weight_indices, self.q_ranks, max_len=self.M_cap)
        segmented_lora_b(t, self.q_B, self.seg_indptr, self.req_weight_indices, self.q_ranks, self.q_scalings, dense,
                         max_len=self.M_cap)
        chunked = torch.zeros_like(dense)
        t = chunked_sgmv_shrink(self.x, self.q_A, self.chunk_indptr, self.chunk_slots, self.q_ranks, self.perm,
                                max_len=16)
        chunked_sgmv_expand(t, self.q_B, self.chunk_indptr, self.chunk_slots, self.q_ranks, self.q_scalings,
                            self.perm, chunked, max_len=16)
        return y, gate_up, virtual, dense, chunked

    def write_batch(self, lens, slots, seed):
        """Write one batch into the static inputs in place (host lists → device, tails reset)."""
        dev = self.x.device
        gen = torch.Generator(dev).manual_seed(seed)
        n, bs = sum(lens), len(lens)
        indptr = [0]
        for ln in lens:
            indptr.append(indptr[-1] + ln)
        self.seg_indptr.copy_(torch.tensor(indptr + [n] * (self.bs_cap - bs), dtype=torch.int32))
        self.req_weight_indices.copy_(torch.tensor(list(slots) + [-1] * (self.bs_cap - bs), dtype=torch.int32))
        self.x.copy_(torch.randn(self.M_cap, self.H, generator=gen, device=dev))
        logits = torch.randn(self.M_cap, self.E, generator=gen, device=dev)
        w, i = torch.topk(torch.softmax(logits, -1), self.k)
        self.ids.copy_(i)
        self.tw.copy_(w / w.sum(-1, keepdim=True))
        # csgmv: tokens stably sorted by slot, chunks of <= 16 never mixing slots, tails empty
        mapping = [s for s, ln in zip(slots, lens) for _ in range(ln)]
        order = sorted(range(n), key=lambda t: mapping[t])
        perm = order + list(range(n, self.M_cap))
        cptr, cslots, run, prev = [0], [], 0, None
        for t in order:
            if mapping[t] == prev and run < 16:
                cptr[-1] += 1
                run += 1
            else:
                cptr.append(cptr[-1] + 1)
                cslots.append(mapping[t])
                prev, run = mapping[t], 1
        cap = self.chunk_slots.shape[0]
        self.perm.copy_(torch.tensor(perm))
        self.chunk_indptr.copy_(torch.tensor(cptr + [n] * (cap + 1 - len(cptr)), dtype=torch.int32))
        self.chunk_slots.copy_(torch.tensor(cslots + [-1] * (cap - len(cslots)), dtype=torch.int32))


def test_every_launcher_in_a_cuda_graph_replays_like_eager():
    layer = _Layer()
    batches = [
        ([20, 1, 33, 7, 2, 9, 4, 1, 3, 16], [0, -1, 1, 3, 1, 2, -1, 0, 3, 1]),  # large: 96 tokens, 10 requests
        ([3, 1], [2, 0]),                                                       # small, after the large one
        ([], []),                                                               # IDLE on the same buffers
        ([1] * 12, [0, 1, 2, 3, -1, 0, 1, 2, 3, -1, 0, 1]),                     # decode-like, full request capacity
    ]
    layer.write_batch(*batches[0], seed=0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles every kernel outside the capture
        layer.step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with launch_guard(), torch.cuda.graph(graph):
        outputs = layer.step()
    for i, (lens, slots) in enumerate(batches):
        layer.write_batch(lens, slots, seed=i)
        with launch_guard():
            graph.replay()
        torch.cuda.synchronize()
        replayed = [o.clone() for o in outputs]
        eager = layer.step()
        torch.cuda.synchronize()
        names = ("y", "gate_up (unfused)", "gate_up (virtual)", "dense (segmented)", "dense (chunked)")
        for name, a, e in zip(names, replayed, eager):
            assert_bitwise_equal(a, e, what=f"batch {i}: replayed {name} vs eager")
        if not lens:
            assert bool((replayed[1] == 0).all()) and bool((replayed[3] == 0).all()), "IDLE replay added a delta"
