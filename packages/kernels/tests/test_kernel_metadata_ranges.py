"""Device metadata out of range, and alignments that do not fit their launch (adversarial findings 6–8).

The launchers never read device values, so the kernels compare the metadata they load against host
ints (slots < L, rows < T, experts < E_w) and what the host knows about an alignment is checked
on the host. Every case runs on pools and activations that are views into sentinel-padded buffers
(NaN or 7.0 just outside the tensors handed to the kernel), so a read outside shows up as NaN in
the result and a write outside as a changed sentinel.

Covers:
- dense kernels (segmented LoRA-A/B, chunked SGMV): a weight index of L, of 10⁶ or below -1, a
  segment end past T, a negative segment start, permutation rows past T or negative: equal to a run
  on the in-range equivalent, nothing outside read or written (finding 6);
"""

import pytest
import torch
from kernel_testing import DEVICE, assert_bitwise_equal, assert_close

from moelora_kernels import chunked_sgmv_expand, chunked_sgmv_shrink, segmented_lora_a, segmented_lora_b

pytestmark = pytest.mark.interpreter
F32 = torch.float32


def _padded(gen, rows, *shape, fill=float("nan")):
    """(view of ``rows`` fresh random rows, the buffer): one ``fill`` row before and after the view."""
    buf = torch.full((rows + 2, *shape), fill, dtype=F32, device=DEVICE)
    buf[1:-1] = torch.randn(rows, *shape, generator=gen).to(DEVICE)
    return buf[1:-1], buf


# --- dense kernels (finding 6) ------------------------------------------------------------------------

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
