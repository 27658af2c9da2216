"""Device metadata out of range, and alignments that do not fit their launch (adversarial findings 6–8).

The launchers never read device values, so the kernels compare the metadata they load against host
ints (slots < L, rows < T, experts < E_w) and what the host knows about an alignment is checked
on the host. Every case runs on pools and activations that are views into sentinel-padded buffers
(NaN or 7.0 just outside the tensors handed to the kernel), so a read outside shows up as NaN in
the result and a write outside as a changed sentinel.

Covers:
- dense kernels (segmented LoRA-A/B, chunked SGMV): a weight index of L, of 10⁶ or below -1, a
  segment end past T, a negative segment start, permutation rows past T or negative: equal to a run
  on the in-range equivalent, nothing outside read or written;
- ``fused_moe_gemm``: an alignment made for more experts than ``w`` holds is refused on the host;
  built by hand (its expert count unknown), blocks of experts >= E_w add nothing and read no
  weight past E_w;
- an alignment written for another pair count than the launch (a static ``AlignOutput`` reused
  for a smaller batch: its padding sentinel is a real pair of the larger launch) is refused by every
  MoE launcher before anything is written; the alignment launchers record the pair and
  expert counts they wrote, in place on ``out``; a hand-built alignment (counts unknown) still runs;
- MoE-LoRA kernels: negative pair indices in a hand-built alignment add nothing and touch no row
  outside the output; a corrupt ``num_tokens_post_padded`` (negative on one slot, past the capacity
  on the last) runs the blocks of the counts clamped to the slot's row, and no block past it.
"""

import pytest
import torch
from kernel_testing import DEVICE, assert_bitwise_equal, assert_close
from moe_lora_testing import check_sentinel_stage, make_pool, named_routing

from moelora_core import AlignOutput, KernelPreconditionError
from moelora_kernels import (
    chunked_sgmv_expand,
    chunked_sgmv_shrink,
    fused_moe_gemm,
    fused_moe_lora,
    fused_moe_lora_expand,
    fused_moe_lora_shrink,
    moe_align_block_size,
    moe_lora_align_block_size,
    moe_lora_delta,
    segmented_lora_a,
    segmented_lora_b,
    stage_tensors,
    virtual_align,
)

pytestmark = pytest.mark.interpreter
F32 = torch.float32


def _padded(gen, rows, *shape, fill=float("nan")):
    """(view of ``rows`` fresh random rows, the buffer): one ``fill`` row before and after the view."""
    buf = torch.full((rows + 2, *shape), fill, dtype=F32, device=DEVICE)
    buf[1:-1] = torch.randn(rows, *shape, generator=gen).to(DEVICE)
    return buf[1:-1], buf


# --- dense kernels ------------------------------------------------------------------------

L, R, HD, N, T = 3, 8, 32, 24, 6
I32 = torch.int32
#: (name, seg_indptr, weight_indices, permutation, max_len) with out-of-range device metadata, and
#: the in-range metadata that must give the same result.
DENSE_CASES = {
    "weight_index_L": (([0, 3, 6], [L, 1], None, 3), ([0, 3, 6], [-1, 1], None, 3)),
    "weight_index_huge": (([0, 3, 6], [10**6, 1], None, 3), ([0, 3, 6], [-1, 1], None, 3)),
    "weight_index_below_minus_one": (([0, 3, 6], [-7, 1], None, 3), ([0, 3, 6], [-1, 1], None, 3)),
    "seg_end_past_T": (([0, 3, 6000], [0, 1], None, 64), ([0, 3, 6], [0, 1], None, 3)),
    "negative_seg_start": (([-4, 3, 6], [0, 1], None, 7), ([0, 3, 6], [0, 1], None, 3)),
    "permutation_row_past_T": (([0, 3, 6], [0, 1], [2, 0, 1, 5, 10**6, 3], 3),
                               ([0, 3, 4, 5, 6], [0, 1, -1, 1], [2, 0, 1, 5, 4, 3], 3)),
    "negative_permutation_row": (([0, 3, 6], [0, 1], [2, -1, 1, 5, 4, 3], 3),
                                 ([0, 1, 2, 3, 6], [0, -1, 0, 1], [2, 0, 1, 5, 4, 3], 3)),
}


def _dense_run(kind, x, A, B, ranks, scalings, meta, out_buf, inter_buf):
    indptr, wi, perm, max_len = meta
    indptr = torch.tensor(indptr, dtype=I32, device=DEVICE)
    wi = torch.tensor(wi, dtype=I32, device=DEVICE)
    if perm is None and kind == "chunked":
        perm = list(range(T))
    perm = None if perm is None else torch.tensor(perm, dtype=torch.int64, device=DEVICE)
    out, inter = out_buf[1:-1], inter_buf[1:-1]
    if kind == "chunked":
        chunked_sgmv_shrink(x, A, indptr, wi, ranks, perm, max_len=max_len, out=inter)
        chunked_sgmv_expand(inter, B, indptr, wi, ranks, scalings, perm, out, max_len=max_len)
    else:
        segmented_lora_a(x, A, indptr, wi, ranks, max_len=max_len, permutation=perm, out=inter)
        segmented_lora_b(inter, B, indptr, wi, ranks, scalings, out, max_len=max_len, permutation=perm)
    return out


@pytest.mark.parametrize("kind", ["segmented", "chunked"])
@pytest.mark.parametrize("case", sorted(DENSE_CASES))
def test_dense_metadata_out_of_range_adds_nothing_and_reads_nothing_outside(kind, case):
    gen = torch.Generator().manual_seed(60)
    # the pool's slots are the first L of L + 1: slot L is a NaN sentinel just past A, B, ranks, σ
    A_buf = torch.randn(L + 1, R, HD, generator=gen) / HD**0.5
    B_buf = torch.randn(L + 1, N, R, generator=gen) / R**0.5
    A_buf[L], B_buf[L] = float("nan"), float("nan")
    ranks_buf = torch.tensor([R, 5, 3, R], dtype=I32)
    scalings_buf = torch.tensor([0.5, 2.0, 1.5, float("nan")])
    A, B, ranks, scalings = (t.to(DEVICE)[:L] for t in (A_buf, B_buf, ranks_buf, scalings_buf))
    x, _ = _padded(gen, T, HD)
    out0 = torch.randn(T, N, generator=gen)
    bad, clean = DENSE_CASES[case]
    results = []
    for meta in (bad, clean):
        out_buf = torch.full((T + 2, N), 7.0, device=DEVICE)
        out_buf[1:-1] = out0.to(DEVICE)
        inter_buf = torch.full((T + 2, R), 7.0, device=DEVICE)
        results.append(_dense_run(kind, x, A, B, ranks, scalings, meta, out_buf, inter_buf))
        for buf, what in ((out_buf, "out"), (inter_buf, "intermediate")):
            assert_bitwise_equal(buf[[0, -1]], torch.full_like(buf[[0, -1]], 7.0), what=f"{case}: {what} sentinels")
    got, want = results
    assert not torch.equal(want.cpu(), out0), "the in-range run adds a delta (the comparison can fail)"
    assert_close(got, want, dtype=F32, what=f"{kind} {case} vs its in-range equivalent")


# --- fused_moe_gemm: experts past the weight ----------------------------------------------

E_W, M, TOP_K = 4, 5, 2
#: experts 4 and 5 do not exist in w (E_w = 4)
GEMM_IDS = [[0, 1], [4, 5], [1, 4], [5, 0], [1, 5]]  # four blocks: all within the grid bound


def _gemm_problem(seed):
    gen = torch.Generator().manual_seed(seed)
    w_buf = torch.randn(E_W + 2, 32, 32, generator=gen, device="cpu").to(DEVICE)
    w_buf[E_W:] = float("nan")  # sentinel experts just past w
    a, _ = _padded(gen, M, 32)
    ids = torch.tensor(GEMM_IDS, dtype=I32, device=DEVICE)
    return w_buf[:E_W], a, ids


def test_fused_moe_gemm_refuses_an_alignment_over_more_experts_than_w():
    w, a, ids = _gemm_problem(61)
    align = moe_align_block_size(ids, E_W + 2, 16)  # aligned with the wrong expert count
    c = torch.full((M * TOP_K, 32), 7.0, device=DEVICE)
    with pytest.raises(KernelPreconditionError, match="experts"):
        fused_moe_gemm(a, w, c, align, top_k=TOP_K, num_pairs=M * TOP_K, in_row_div=TOP_K)
    assert bool((c == 7.0).all()), "nothing is written before the refusal"


def test_fused_moe_gemm_skips_blocks_of_experts_past_w_in_a_hand_built_alignment():
    w, a, ids = _gemm_problem(62)
    made = moe_align_block_size(ids, E_W + 2, 16)
    align = AlignOutput(*made)  # built from tensors: the expert count is unknown on the host
    c = torch.full((M * TOP_K, 32), 7.0, device=DEVICE)
    fused_moe_gemm(a, w, c, align, top_k=TOP_K, num_pairs=M * TOP_K, in_row_div=TOP_K)
    flat = ids.reshape(-1).cpu()
    inside = flat < E_W
    want = torch.stack([a[p // TOP_K].cpu().double() @ w[flat[p]].cpu().double().T if inside[p]
                        else torch.full((32,), 7.0, dtype=torch.float64) for p in range(M * TOP_K)])
    assert_close(c[inside.to(DEVICE)], want[inside], dtype=F32, what="pairs of experts in w")
    assert bool((c.cpu()[~inside] == 7.0).all()), "rows of pairs of experts past w stay unwritten"


# --- alignments for another pair count ----------------------------------------------------

LM, EM, M_BIG, M_SMALL = 3, 5, 9, 4


def _moe_problem(seed):
    gen = torch.Generator().manual_seed(seed)
    weights = make_pool(seed, L=LM, E=EM, H=40, I=24, R=16)
    ids = torch.randint(0, EM, (M_BIG, TOP_K), generator=gen, dtype=I32).to(DEVICE)
    mapping = torch.tensor([0, 1, 2, -1, 0, 1, 1, 2, 0], dtype=I32, device=DEVICE)
    enabled = torch.ones(LM, dtype=I32, device=DEVICE)
    x = torch.randn(M_BIG, 40, generator=gen).to(DEVICE)
    return weights, ids, mapping, enabled, x


def _small_alignment(ids, mapping, enabled, *, base=False):
    """A static AlignOutput of the large batch's capacity, rewritten for the first M_SMALL tokens
    (per slot, or the base layout of one slot with ``base``)."""
    align = AlignOutput.empty(1 if base else LM, M_BIG, TOP_K, EM, 16, DEVICE)
    small = ids[:M_SMALL].contiguous()
    # the return values are ignored: `align` itself must say what it holds now
    if base:
        moe_align_block_size(small, EM, 16, out=align)
    else:
        moe_lora_align_block_size(small, mapping[:M_SMALL].contiguous(), EM, 16, LM, enabled, out=align)
    return align


def test_alignment_launchers_record_their_pair_and_expert_counts_on_out():
    _, ids, mapping, enabled, _ = _moe_problem(63)
    align = _small_alignment(ids, mapping, enabled)
    assert (align.num_pairs, align.num_experts) == (M_SMALL * TOP_K, EM)
    fresh = moe_lora_align_block_size(ids, mapping, EM, 16, LM, enabled)
    assert (fresh.num_pairs, fresh.num_experts) == (M_BIG * TOP_K, EM)
    base = moe_align_block_size(ids, EM + 1, 16)
    assert (base.num_pairs, base.num_experts) == (M_BIG * TOP_K, EM + 1)
    _, virtual = virtual_align(ids, mapping, EM, LM)
    assert (virtual.num_pairs, virtual.num_experts) == (M_BIG * TOP_K, EM * LM)


MOE_LAUNCHES = {
    "moe_lora_delta-fused": lambda t, x, out, al, w: moe_lora_delta("gate_up", x, out, w, al, top_k=TOP_K, fused=True),
    "moe_lora_delta-pair": lambda t, x, out, al, w: moe_lora_delta("gate_up", x, out, w, al, top_k=TOP_K, fused=False),
    "fused_moe_lora": lambda t, x, out, al, w: fused_moe_lora(x, t["lora_a"], t["lora_b"], al, out, stage="gate_up",
                                                              top_k=TOP_K, ranks=t["ranks"], scalings=t["scalings"]),
    "fused_moe_lora_shrink": lambda t, x, out, al, w: fused_moe_lora_shrink(x, t["lora_a"], al, stage="gate_up",
                                                                            top_k=TOP_K, ranks=t["ranks"]),
    "fused_moe_lora_expand": lambda t, x, out, al, w: fused_moe_lora_expand(
        torch.zeros(2, M_BIG * TOP_K, 16, device=DEVICE), t["lora_b"], al, out, stage="gate_up", top_k=TOP_K,
        ranks=t["ranks"], scalings=t["scalings"]),
    "fused_moe_gemm": lambda t, x, out, al, w: fused_moe_gemm(
        x, t["lora_a"][0, 0], out.view(M_BIG * TOP_K, -1)[:, :16], al, top_k=TOP_K, num_pairs=M_BIG * TOP_K,
        in_row_div=TOP_K),
}


@pytest.mark.parametrize("launch", sorted(MOE_LAUNCHES))
def test_moe_launchers_refuse_an_alignment_written_for_another_pair_count(launch):
    # Regression: an alignment of M = 4 tokens used with x of M = 9 took its
    # padding sentinel 4·top_k for a real pair, and token 4 got a spurious delta.
    weights, ids, mapping, enabled, x = _moe_problem(64)
    align = _small_alignment(ids, mapping, enabled, base=launch == "fused_moe_gemm")
    out = torch.full((M_BIG, TOP_K, 2 * 24), 7.0, device=DEVICE)
    with pytest.raises(KernelPreconditionError, match="pairs"):
        MOE_LAUNCHES[launch](stage_tensors(weights, "gate_up"), x, out, align, weights)
    assert bool((out == 7.0).all()), "nothing is written before the refusal"


def test_a_hand_built_alignment_of_unknown_pair_count_still_runs():
    weights, ids, mapping, enabled, x = _moe_problem(65)
    made = moe_lora_align_block_size(ids, mapping, EM, 16, LM, enabled)
    out = torch.zeros(M_BIG, TOP_K, 48, device=DEVICE)
    moe_lora_delta("gate_up", x, out, weights, AlignOutput(*made), top_k=TOP_K, adapter_enabled=enabled)
    want = torch.zeros_like(out)
    moe_lora_delta("gate_up", x, want, weights, made, top_k=TOP_K, adapter_enabled=enabled)
    assert_bitwise_equal(out, want, what="the same alignment with and without its recorded counts")


# --- MoE-LoRA: negative pair indices --------------------------------------------------------------------


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "shrink-expand"])
def test_moe_lora_skips_negative_pairs_and_writes_nothing_outside_out(fused):
    weights, ids, mapping, enabled, _ = _moe_problem(66)
    gen = torch.Generator().manual_seed(66)
    x, _ = _padded(gen, M_BIG, 40)
    made = moe_lora_align_block_size(ids, mapping, EM, 16, LM, enabled)
    corrupt = AlignOutput(*(t.clone() for t in made))
    real = corrupt.sorted_token_ids < M_BIG * TOP_K
    corrupt.sorted_token_ids[~real] = -TOP_K - 1  # every padding row of every slot points before row 0
    results = []
    for align in (made, corrupt):
        out_buf = torch.full((M_BIG + 2, TOP_K, 48), 7.0, device=DEVICE)
        moe_lora_delta("gate_up", x, out_buf[1:-1], weights, align, top_k=TOP_K, adapter_enabled=enabled, fused=fused)
        assert_bitwise_equal(out_buf[[0, -1]], torch.full_like(out_buf[[0, -1]], 7.0), what="rows around out")
        results.append(out_buf[1:-1])
    assert_bitwise_equal(results[1], results[0], what="negative pair indices add nothing")


# --- MoE-LoRA: counts out of range ----------------------------------------------------------------


@pytest.mark.parametrize("path", ["fused", "pair"])
@pytest.mark.parametrize("stage", ["gate_up", "down"])
def test_moe_lora_clamps_a_corrupt_num_tokens_post_padded_to_the_slots_row(stage, path):
    # Regression: the flat grid finds a program's slot from the counts, so a count is clamped to
    # [0, the host's per-slot bound] before the cumulative sum. Slot 0's count is negative (no block:
    # unclamped, it would shift every later slot's blocks by one); the last slot's is 10 blocks past
    # its row (unclamped, the blocks after its row would be read: the sentinel slot's real pairs).
    # Equal to the twin on the counts clamped to [0, P]; blocks past the used ones hold expert -1.
    weights = make_pool(67, L=3)
    M_C, k = 24, 2
    _, ids, mapping = named_routing(67, weights.spec, M_C, k)
    enabled = torch.ones(3, dtype=I32, device=DEVICE)
    made = moe_lora_align_block_size(ids, mapping, weights.spec.E, 16, 3, enabled)
    P = made.sorted_token_ids.shape[1]
    counts = made.num_tokens_post_padded.clone()
    counts[0], counts[2] = -16, P + 10 * 16
    corrupt = made._replace(num_tokens_post_padded=counts).set_launch(M_C * k, weights.spec.E)
    clamped = made._replace(num_tokens_post_padded=counts.clamp(0, P))
    reached = torch.tensor([0, 1, 1], dtype=I32, device=DEVICE)
    assert bool((mapping == 0).any()) and bool((mapping == 2).any()), "both corrupt slots hold tokens"
    out, out0 = check_sentinel_stage(path, stage, weights, ids, mapping, enabled, corrupt, 67,
                                     f"corrupt counts {path} {stage}", want_align=clamped, reached=reached)
    assert not torch.equal(out.cpu(), out0.cpu()), "the live slots added nothing"
