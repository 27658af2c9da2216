"""SGLang 0.5.23's MoE-LoRA hooks as its csgmv LoRA backend runs them: the ``legacy`` and
``virtual_experts`` paths.

Both run SGLang's call sites in ``sglang/srt/lora/lora_moe_runners.py`` unchanged:
``_add_lora_gate_up_delta`` (before the activation) and ``_add_lora_down_delta`` (router-weighted),
on a ``LoRAInfo`` built from moelora's batch info and the SGLang-layout copy of the pool
(:mod:`moelora_peers.sglang_pool`):

- ``legacy`` (``lora_use_virtual_experts=False``, SGLang's default): the per-slot alignment of
  ``_compute_lora_alignment`` (BLOCK_M 64; one per layer, shared by both stages as
  ``build_lora_hooks`` shares it), then ``fused_moe_lora`` (``fused_moe_lora_kernel.py``: shrink and
  expand, the block configs of ``_get_moe_lora_block_config``, ``adapter_enabled``, ``lora_ids``);
- ``virtual_experts`` (``--lora-use-virtual-experts``): ``merged_experts_fused_moe_lora_add``
  (``virtual_experts.py``: (slot, expert) → ``slot * E + expert``, the split-K shrink, SGLang's base
  ``invoke_fused_moe_kernel`` as the expand with ``fuse_add_to_output`` and the token mask), its
  routing cached per layer in one ``routing_cache`` shared by both stages as ``build_lora_hooks``
  shares it.

What is written here (small; each follows the SGLang function named): the ``LoRAInfo`` fields from
moelora's info (``base_backend._add_moe_lora_info``: SGLang's per-request ``seg_indptr`` /
``req_to_lora`` are moelora's ``req_seg_indptr`` / ``req_weight_indices``; ``adapter_enabled``,
``token_lora_mapping``; ``lora_ranks``, of which the MoE call sites read only the length, the
slot count), the legacy capture buffers of each graph family, allocated once at the family's
capacity (as SGLang's graph runner allocates ``cg_buffers`` at ``max_bs``), and the capture flag
around a graph family's calls (``get_is_capture_mode()``: SGLang's graph runner sets it while
capturing).

CPU substitutes (no CUDA device; each named in the cells' records, conformance/docs/peers.md; the
legacy ones also on a GPU machine without SGLang's JIT toolchain, :func:`jit_align_available`):

- legacy: the JIT CUDA ``moe_lora_align_block_size`` → moelora's Triton ``moe_lora_align_block_size``
  (same contract, DESIGN.md §4; graph-safe) for every batch SGLang sends to the JIT kernel (graph
  families, into SGLang's capture buffers ``cg_buffers``; eager batches above SGLang's sparsity
  bound). Sparse eager batches take SGLang's own ``_naive_moe_lora_align_block_size``, as on CUDA;
- virtual_experts: SGLang's native ``moe_align_block_size`` (sgl_kernel, CUDA) → SGLang's own
  pure-torch fallback ``_align_block_size_torch`` (``virtual_experts.py``, "for platforms where the
  CUDA JIT kernel is unavailable"), run eagerly (not under ``torch.compile``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from functools import partial

import torch

from moelora_core.align import AlignOutput, align_capacity
from moelora_core.backend_checks import GraphCapacity
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import Capabilities
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.weights import LoRAWeights
from moelora_kernels.align import moe_lora_align_block_size
from moelora_peers import sglang_modules
from moelora_peers.peer_backend import PeerPath, fp32_declared, peer_capabilities
from moelora_peers.sglang_dense import csgmv_dense_delta
from moelora_peers.sglang_pool import SGLangPool
from moelora_peers.stubs._platform import is_cuda

#: BLOCK_M of the legacy alignment (``_compute_lora_alignment``: ``shrink_config = {"BLOCK_SIZE_M": 64}``).
LEGACY_BLOCK_M = 64
I32 = torch.int32


def _capture(on: bool):
    """SGLang's capture flag (``get_is_capture_mode``) for the duration of a call."""
    return sglang_modules.module("capture").capture_mode(on)


class _Layer:
    """What one layer's two stages share (as ``build_lora_hooks``'s closures share it): the legacy
    alignment, or the virtual-experts routing cache."""

    def __init__(self, alignment: tuple | None, routing_cache: dict | None) -> None:
        self.alignment = alignment  # (sorted_token_ids [L, P], expert_ids [L, P/64], ntpp [L], lora_ids [L])
        self.routing_cache = routing_cache


class SGLangHooksPath:
    """The legacy / virtual-experts call sites on one spec (module docstring)."""

    def __init__(self, spec: LoRALayerSpec, virtual: bool) -> None:
        self.spec = spec
        self.virtual = virtual
        self.runners = sglang_modules.module("runners")
        self.pool = SGLangPool(spec)
        self._cg: dict[str, dict[str, torch.Tensor]] = {}
        # LoRAInfo.lora_ranks where no weights are at hand (the alignment): the MoE call sites read
        # only its length (``max_loras = len(lora_info.lora_ranks)``).
        self._slots = torch.zeros(spec.max_loras, dtype=I32, device=spec.device)

    # --- LoRAInfo from moelora's info (base_backend._add_moe_lora_info) ----------------------------

    def lora_info(self, weights: LoRAWeights | None, info: LoRABatchInfo):
        """SGLang's ``LoRAInfo`` for ``info`` (weights None: the alignment reads no weight)."""
        b = self.pool.buffers(weights) if weights is not None else None
        family = info.private.get("family")
        return self.runners.LoRAInfo(
            gate_up_lora_a_weights=b and b.gate_up_a, gate_up_lora_b_weights=b and b.gate_up_b,
            down_lora_a_weights=b and b.down_a, down_lora_b_weights=b and b.down_b,
            seg_indptr=info.req_seg_indptr, req_to_lora=info.req_weight_indices,
            lora_ranks=weights.ranks("gate") if weights is not None else self._slots,
            adapter_enabled=info.adapter_enabled, token_lora_mapping=info.token_lora_mapping,
            max_lora_rank=self.spec.R, num_experts=self.spec.E, has_active_lora=info.has_active_lora,
            experts_shared_outer_loras=False, cg_buffers=self._cg[family] if family is not None else None,
            lora_use_virtual_experts=self.virtual,
        )

    def init_graph(self, family: str, capacity: GraphCapacity) -> None:
        """The family's capture buffers of ``_compute_lora_alignment`` (SGLang allocates them with the
        graph runner's MoE-LoRA buffers), sized from the family's token capacity, once; every bucket
        aligns into views of them."""
        s = self.spec
        P = align_capacity(capacity.max_tokens, s.top_k, s.E, LEGACY_BLOCK_M)
        dev = s.device
        self._cg[family] = {
            "sorted_token_ids_lora": torch.empty(s.max_loras * P, dtype=I32, device=dev),
            "expert_ids_lora": torch.empty(s.max_loras * (P // LEGACY_BLOCK_M), dtype=I32, device=dev),
            "num_tokens_post_padded_lora": torch.empty(s.max_loras, dtype=I32, device=dev),
            "lora_ids": torch.arange(s.max_loras, dtype=I32, device=dev),
        }

    # --- the layer's alignment ----------------------------------------------------------------------

    def align(self, topk_ids: torch.Tensor, info: LoRABatchInfo) -> _Layer:
        if self.virtual:
            return _Layer(None, {})  # build_lora_hooks: one routing cache per layer
        lora_info = self.lora_info(None, info)
        with _capture(info.use_cuda_graph):
            if jit_align_available():
                alignment = self.runners._compute_lora_alignment(topk_ids, lora_info)
            else:
                alignment = self._cpu_alignment(topk_ids, lora_info, info.use_cuda_graph)
        return _Layer(alignment, None)

    def _cpu_alignment(self, topk_ids: torch.Tensor, lora_info, graph: bool) -> tuple:
        """``_compute_lora_alignment`` without the JIT align: SGLang's own choice (its naive fallback
        for sparse eager batches, ``M * top_k * _SPARSITY_FACTOR <= E * max_loras``, as on CUDA), the
        JIT kernel's batches served by moelora's Triton align (the same contract, DESIGN.md §4) into
        SGLang's capture buffers in a graph family and fresh buffers eagerly."""
        s = self.spec
        L, M = s.max_loras, topk_ids.shape[0]
        P = align_capacity(M, s.top_k, s.E, LEGACY_BLOCK_M)
        if not graph and M * topk_ids.shape[1] * self.runners._SPARSITY_FACTOR <= s.E * L:
            sorted_ids, expert_ids, ntpp = self.runners._naive_moe_lora_align_block_size(
                topk_ids, lora_info.seg_indptr, lora_info.req_to_lora, s.E, LEGACY_BLOCK_M, L, P,
                P // LEGACY_BLOCK_M, lora_info.adapter_enabled, topk_ids.device)
            return sorted_ids.view(L, -1), expert_ids.view(L, -1), ntpp, torch.arange(L, dtype=I32,
                                                                                        device=topk_ids.device)
        if graph:
            cg = lora_info.cg_buffers
            out = AlignOutput(cg["sorted_token_ids_lora"][: L * P].view(L, P),
                              cg["expert_ids_lora"][: L * (P // LEGACY_BLOCK_M)].view(L, -1),
                              cg["num_tokens_post_padded_lora"][:L])
            lora_ids = cg["lora_ids"][:L]
        else:
            out = AlignOutput.empty(L, M, s.top_k, s.E, LEGACY_BLOCK_M, device=topk_ids.device)
            lora_ids = torch.arange(L, dtype=I32, device=topk_ids.device)
        ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
        moe_lora_align_block_size(ids, lora_info.token_lora_mapping, s.E, LEGACY_BLOCK_M, L,
                                  lora_info.adapter_enabled, out=out)
        return out[0].view(L, -1), out[1].view(L, -1), out[2], lora_ids

    # --- the two stages (lora_moe_runners._add_lora_*_delta) ------------------------------------------

    def gate_up(self, x, topk_ids, gate_up_out, weights, info, layer: _Layer) -> None:
        # The gate_up stage takes topk_weights for their shape only (mul_routed_weight=False).
        topk_weights = torch.empty(topk_ids.shape, dtype=torch.float32, device=x.device)
        self._stage(self.runners._add_lora_gate_up_delta, x, gate_up_out, topk_weights, topk_ids, weights, info,
                    layer)

    def down(self, h, topk_ids, topk_weights, down_out, weights, info, layer: _Layer) -> None:
        self._stage(self.runners._add_lora_down_delta, h, down_out, topk_weights, topk_ids, weights, info, layer)

    def _stage(self, fn, inp, out, topk_weights, topk_ids, weights, info, layer: _Layer) -> None:
        lora_info = self.lora_info(weights, info)
        a = layer.alignment or (None, None, None, None)
        mapping = lora_info.token_lora_mapping if self.virtual else None
        # SGLang's MoE caches are in the model dtype, the LoRA buffers' dtype, and its kernels rely on
        # it: ``_fused_moe_lora_kernel`` reads the weights through a pointer cast to the *output's*
        # element type (``tl.pointer_type(c_ptr.dtype.element_ty)``), so an fp32 output over fp16
        # weights reads garbage (conformance/docs/peers.md, "SGLang's kernels assume one dtype").
        # moelora's protocol lets the caller keep fp32 intermediates: the inputs then run in the model
        # dtype and the delta lands in a model-dtype buffer that is added to ``out``, as SGLang's
        # caches would hold it.
        dt = self.spec.dtype
        inp = inp if inp.dtype == dt else inp.to(dt)
        target = out if out.dtype == dt else torch.zeros(out.shape, dtype=dt, device=out.device)
        with _capture(info.use_cuda_graph):
            fn(inp, target, topk_weights, topk_ids, lora_info, mapping, *a, routing_cache=layer.routing_cache)
        if target is not out:
            out.add_(target.to(out.dtype))

    # --- for the suite's exact check of SGLang's own alignment (property P07) ---------------------------

    def alignment(self, topk_ids: torch.Tensor, info: LoRABatchInfo) -> tuple:
        sorted_ids, expert_ids, ntpp, _ = self.align(topk_ids, info).alignment
        return AlignOutput(sorted_ids, expert_ids, ntpp), LEGACY_BLOCK_M


def jit_align_available() -> bool:
    """Whether SGLang's JIT CUDA align can run here: a CUDA device, its JIT runtime (apache-tvm-ffi)
    and a CUDA compiler (``load_jit`` compiles ``moe_lora_align_kernel.cu`` on first use)."""
    return is_cuda() and importlib.util.find_spec("tvm_ffi") is not None and (
        shutil.which("nvcc") is not None or bool(os.environ.get("CUDA_HOME")))


def capabilities(virtual: bool, device: torch.device | str = "cpu") -> Capabilities:
    """What the two hook paths declare on ``device`` (conformance/docs/peers.md, "Capabilities").

    The virtual-experts expand (``invoke_fused_moe_kernel`` with ``a_output_slices=2``) asserts
    fp16 / bf16. The legacy ``fused_moe_lora`` and the csgmv dense kernels call ``tl.dot`` without
    ``input_precision``: TF32 for fp32 operands on NVIDIA, IEEE under the CPU interpreter, and SGLang
    serves fp16 / bf16 models; so fp32 is declared off CUDA only (:func:`fp32_declared`). The legacy path's consumer
    (``_fused_moe_lora_kernel``) returns on a disabled slot before any alignment load, and SGLang's
    JIT align leaves that slot's rows untouched (``alignment_reads_disabled_slots=False``).
    """
    if virtual:  # no per-slot alignment hook
        return peer_capabilities({torch.float16, torch.bfloat16}, virtual_experts=True)
    dtypes = {torch.float16, torch.bfloat16} | ({torch.float32} if fp32_declared(device) else set())
    return peer_capabilities(dtypes, alignment_reads_disabled_slots=False)


def make_path(spec: LoRALayerSpec, *, virtual: bool) -> PeerPath:
    """The :class:`~moelora_peers.peer_backend.PeerPath` of the legacy or virtual-experts path."""
    path = SGLangHooksPath(spec, virtual)
    subs = {}
    if (virtual and not sglang_modules.native_moe_align_available()) or (not virtual and not jit_align_available()):
        subs = ({"sgl_kernel moe_align_block_size": "virtual_experts._align_block_size_torch (SGLang's torch "
                 "fallback, eager)"} if virtual else
                {"JIT moe_lora_align_block_size": "moelora_kernels.align.moe_lora_align_block_size (the batches "
                 "SGLang sends to the JIT kernel; sparse eager batches take SGLang's own "
                 "_naive_moe_lora_align_block_size, as on CUDA)"})
    return PeerPath(
        peer="sglang", path="virtual_experts" if virtual else "legacy",
        version=sglang_modules.importer().dist.version, capabilities=capabilities(virtual, spec.device),
        on_slot_loaded=path.pool.on_slot_loaded, align=path.align, gate_up=path.gate_up, down=path.down,
        dense=partial(csgmv_dense_delta, path.pool),
        alignment=None if virtual else path.alignment, init_graph=path.init_graph,
        cpu_substitutes=subs,
    )
