"""vLLM's MoE-LoRA path as a moelora backend: ``--backend moelora_peers.vllm:fused``.

vLLM's own code runs, unchanged: the punica wrapper ``PunicaWrapperGPU``
(``vllm/lora/punica_wrapper/punica_gpu.py``) — ``update_metadata`` (``convert_mapping`` and
``LoRAKernelMeta.prepare_tensors``: vLLM's per-token metadata), ``add_lora_w13`` / ``add_lora_w2``
(its alignment choice — ``naive_block_assignment`` for sparse batches, else ``moe_lora_align_block_size``
—, the configs of ``get_lora_op_configs``, ``add_lora_fused_moe`` → ``fused_moe_lora``, which picks
the small-batch, one-shot or two-kernel path itself) and ``add_lora_linear`` (``lora_shrink`` /
``lora_expand``) for the dense modules.

What is written here (each following the vLLM function named): the ``LoRAMapping`` of a batch (per
token the slot's LoRA id ``slot + 1``, 0 for base tokens and graph padding, as the GPU model runner's
``_set_active_loras`` pads it to the captured size) and ``lora_index_to_id`` (slot → id), one punica
wrapper per graph family, made at the family's capacity (its ``LoRAKernelMeta`` buffers are static,
as vLLM keeps one per runner; every bucket writes their prefix) and a fresh one per eager batch;
the weight layout of ``FusedMoEWithLoRA`` (w13: gate and up ``lora_a`` [L, E, R, H], ``lora_b``
[L, E, I, R]; w2: [L, E, R, I] / [L, E, H, R]; linear [L, 1, R, in] / [L, 1, out, R]) with σ
folded into every B (``LoRALayerWeights.optimize``), each module's own σ.

Stubs (conformance/docs/peers.md): ``vllm.platforms``, ``vllm.distributed``, ``vllm.triton_utils``,
``vllm.logger``, ``vllm.utils.mem_utils``, ``vllm._custom_ops`` (its align served by moelora's Triton
align: a stand-in on every device, vLLM's compiled op does not load here), ``vllm.lora.layers``,
``vllm.lora.layers.utils``, ``vllm.lora.utils``, ``vllm.model_executor.layers.fused_moe.config``.
The configs come from ``get_lora_op_configs`` (``use_tuned_config=True``: vLLM's path when
``VLLM_TUNED_CONFIG_FOLDER`` is set) because the default path's base-MoE config lookup imports the
compiled ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from moelora_core.backend_checks import GraphCapacity
from moelora_core.batch import BatchSpec
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import Capabilities
from moelora_core.forward_mode import ForwardMode
from moelora_core.graphs import mark_host_memory
from moelora_core.layer_spec import LoRALayerSpec
from moelora_peers import vllm_modules
from moelora_peers.peer_backend import PeerBackend, PeerPath, peer_capabilities
from moelora_peers.sglang_pool import SGLangPool
from moelora_peers.stubs._platform import is_cuda


@dataclass
class _Layer:
    """One layer forward: the punica wrapper and the alignment ``add_lora_w13`` returns for w2."""

    punica: object
    alignment: tuple | None = None
    extra: dict = field(default_factory=dict)


class VLLMFusedPath:
    """vLLM's punica wrapper on one spec (module docstring)."""

    def __init__(self, spec: LoRALayerSpec) -> None:
        self.spec = spec
        self.pool = SGLangPool(spec, fold_dense=True)
        self.punica_mod = vllm_modules.module("punica_gpu")
        self.LoRAMapping = vllm_modules.module("lora_layers").LoRAMapping
        self._families: dict[str, object] = {}

    def _wrapper(self, max_tokens: int, max_batches: int):
        cfg = SimpleNamespace(max_loras=self.spec.max_loras, specialize_active_lora=False)
        punica = self.punica_mod.PunicaWrapperGPU(max_tokens, max_batches, self.spec.device, lora_config=cfg)
        # LoRAKernelMeta keeps its no-LoRA flag and active-LoRA counts in host tensors (device="cpu",
        # read with .item() inside the ops: no sync on a GPU). On a CPU machine every tensor is on
        # "cpu"; registering them as host memory tells moelora's graph emulator what they are.
        for meta in (punica.token_mapping_meta, punica.prompt_mapping_meta):
            for name in ("no_lora_flag_cpu", "num_active_loras_cpu", "default_num_active_loras_cpu"):
                mark_host_memory(getattr(meta, name))
        return punica

    def init_graph(self, family: str, capacity: GraphCapacity) -> None:
        """The family's punica wrapper, at the family's capacity (vLLM keeps one ``LoRAKernelMeta``
        per runner, sized at ``max_num_batched_tokens``; every captured size reads its prefix)."""
        self._families[family] = self._wrapper(capacity.max_tokens, capacity.max_requests)

    def update(self, batch: BatchSpec, info: LoRABatchInfo, family: str | None) -> None:
        """vLLM's ``update_metadata`` for ``batch`` (the wrapper goes in ``info.private["punica"]``)."""
        rows = info.token_lora_mapping.numel()  # graph mode: the bucket's token capacity
        if family is not None:
            punica = self._families[family]
        else:
            punica = self._wrapper(max(rows, 1), max(batch.bs, 1))
        # GPU model runner's _set_active_loras: LoRA id = slot + 1, 0 for base tokens and the padding.
        ids = [s + 1 if s >= 0 else 0 for s in batch.token_lora_mapping] + [0] * (rows - batch.num_tokens)
        mapping = self.LoRAMapping(ids, ids, is_prefill=batch.forward_mode is not ForwardMode.DECODE)
        punica.update_metadata(mapping, [s + 1 for s in range(self.spec.max_loras)], self.spec.max_loras, 1)
        info.private["punica"] = punica

    def align(self, topk_ids: torch.Tensor, info: LoRABatchInfo) -> _Layer:
        return _Layer(info.private["punica"])

    def _md(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.dtype == self.spec.dtype else t.to(self.spec.dtype)

    def gate_up(self, x, topk_ids, gate_up_out, weights, info, layer: _Layer) -> None:
        b, s = self.pool.buffers(weights), self.spec
        R, I = s.R, s.I  # noqa: E741
        T, k = topk_ids.shape
        target = gate_up_out if gate_up_out.dtype == s.dtype else torch.zeros(gate_up_out.shape, dtype=s.dtype,
                                                                              device=gate_up_out.device)
        # add_lora_w13 reads topk_weights for their shape only (mul_routed_weight is False for w13).
        topk_weights = torch.empty(T, k, dtype=torch.float32, device=x.device)
        layer.alignment = layer.punica.add_lora_w13(
            target, self._md(x), (b.gate_up_a[:, :, :R], b.gate_up_a[:, :, R:]),
            (b.gate_up_b[:, :, :I], b.gate_up_b[:, :, I:]), topk_ids, topk_weights, None, None, None, T, k,
            s.max_loras, info.adapter_enabled, s.E, k, 2, False, True)
        if target is not gate_up_out:
            gate_up_out.add_(target.to(gate_up_out.dtype))

    def down(self, h, topk_ids, topk_weights, down_out, weights, info, layer: _Layer) -> None:
        b, s = self.pool.buffers(weights), self.spec
        T, k = topk_ids.shape
        if layer.alignment is None:  # the w2 stage of a layer whose w13 stage did not run
            layer.alignment = (None, None, None, None)
        sorted_ids, expert_ids, ntpp, mapping = layer.alignment
        target = down_out if down_out.dtype == s.dtype else torch.zeros(down_out.shape, dtype=s.dtype,
                                                                        device=down_out.device)
        layer.punica.add_lora_w2(
            target, self._md(h), (b.down_a,), (b.down_b,), topk_weights.float(), sorted_ids, expert_ids, ntpp,
            mapping, T, None, None, k, s.max_loras, info.adapter_enabled, k, False, 0, True)
        if target is not down_out:
            down_out.add_(target.to(down_out.dtype))

    def dense(self, module: str, x, out, weights, info) -> None:
        b = self.pool.buffers(weights)
        A, B = b.dense_a[module][:, None], b.dense_b[module][:, None]
        punica = info.private["punica"]
        # lora_expand asserts a contiguous output: vLLM calls it once per (fused) layer output; the
        # protocol hands one module's columns (a strided view of a fused qkv buffer). Such an ``out``
        # gets the delta through a contiguous buffer.
        direct = out.dtype == self.spec.dtype and out.is_contiguous()
        target = out if direct else torch.zeros(out.shape, dtype=self.spec.dtype, device=out.device)
        punica.add_lora_linear(target, self._md(x).contiguous(), (A,), (B,), 1.0, (B.shape[2],))
        if target is not out:
            out.add_(target.to(out.dtype))


def capabilities() -> Capabilities:
    """What vLLM's fused path declares (conformance/docs/peers.md, "Capabilities")."""
    return peer_capabilities({torch.float16, torch.bfloat16})


def make_path(spec: LoRALayerSpec) -> PeerPath:
    path = VLLMFusedPath(spec)
    subs = {"vllm._custom_ops.moe_lora_align_block_size (compiled, not loadable)":
            "moelora_kernels.align.moe_lora_align_block_size (stand-in on every device)"}
    return PeerPath(
        peer="vllm", path="fused", version=vllm_modules.importer().dist.version, capabilities=capabilities(),
        on_slot_loaded=path.pool.on_slot_loaded, align=path.align, gate_up=path.gate_up, down=path.down,
        dense=path.dense, init_graph=path.init_graph, prepare=path.update,
        cpu_substitutes=subs if not is_cuda() else {},
    )


def fused(spec: LoRALayerSpec) -> PeerBackend:
    """``moelora_peers.vllm:fused``: vLLM's punica wrapper and ``fused_moe_lora`` (the path's
    ``prepare`` runs vLLM's ``update_metadata`` beside moelora's metadata)."""
    return PeerBackend(spec, make_path)
