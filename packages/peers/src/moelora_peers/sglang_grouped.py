"""SGLang 0.5.23's plan-based MoE-LoRA path (``sglang/srt/lora/moe/{plan,routing,runner}.py``): the
``grouped`` backend.

What runs is SGLang's, unchanged:

- ``resolve_plans(...)`` for the device (``architecture_for_capability``: ``sm90`` / ``sm100`` tables
  on those GPUs; ``default`` elsewhere, the CPU included), per-expert layout, the pool's rank, SiLU,
  the layer's H and E: one plan per phase (EXTEND batches → ``Phase.PREFILL``, DECODE → ``DECODE``)
  and its tile table (``TileTable.config_for(num_tokens)``);
- ``build_moe_routes(plan, ...)`` on the layer's ``topk_ids`` and token mapping, once per layer
  (shared by both stages, as ``MoeLoraRunner.run`` builds them once), with SGLang's ``LoraWorkspace``
  (one per graph family and one for eager batches, as SGLang keeps graph storage apart);
- the runner's stage methods ``MoeLoraRunner._run_a`` and ``_run_b`` on a runner whose provider
  carries only the geometry (:class:`GeometryProvider`: H, I, E, 2 gate/up slices, the delta dtype),
  and ``invoke_down_b_into_base`` where the plan adds down-B into the base rows.

What is moelora's (the base GEMMs, the activation, the overlap streams and the finalize are the
caller's, DESIGN.md §5), written here in a few lines, each following the SGLang function named:

- gate_up: the delta [T·k, 2I] ([gate | up]) is added to ``gate_up_out`` before the activation, as
  ``act_delta`` adds it (``HAS_DELTA``). Plans whose act family is ``b_activation`` fuse gate_up B
  into the activation (``fused_b_act``), which the protocol cannot express (the activation is the
  caller's): gate_up B then runs as the standalone grouped B stage the decode plans use
  (``BSpec(GATE_UP, GROUPED)``, the tile table's ``gate_up_b`` config);
- down: the delta [T·k, H] is router-weighted into ``down_out`` (SGLang's materialized finalize
  weights base and delta together; moelora's ``down_out`` is already weighted). Plans with
  ``down_b_into_base`` add down-B into the *unweighted* base rows (``invoke_down_b_into_base``):
  here into zeroed rows (``pair_to_row`` the identity), then weighted and added;
- overlaps (``gate_up_overlap``, ``down_overlap``, ``route_builder=parallel_shared_outer``) run the
  stages in order on one stream, as ``LoraWorkspace.run_parallel`` does off CUDA.

Dtypes: SGLang's runner admits BF16 layers only (``MoeLoraRunner._weight_family``); its stage
kernels are dtype-generic and run here in the case dtype (``lora_delta_dtype`` = the spec's dtype),
so CPU cells (fp32 / fp16 under the interpreter) exercise the kernels outside SGLang's admitted
dtype; GPU cells run bf16 as SGLang does (conformance/docs/peers.md).

CPU substitute: ``common/lora_b.slice_geometry`` (CUDA-only tables) →
:mod:`moelora_peers.substitutes.sglang_slice_geometry`. Routes of more than 512 pairs on a CPU would
reach ``_align_block_size_jit`` (CUDA JIT; the interpret profile draws at most 192 pairs).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import Capabilities
from moelora_core.forward_mode import ForwardMode
from moelora_core.layer_spec import LoRALayerSpec
from moelora_core.weights import LoRAWeights
from moelora_peers import sglang_modules
from moelora_peers.peer_backend import PeerPath, fp32_declared, peer_capabilities
from moelora_peers.sglang_dense import csgmv_dense_delta
from moelora_peers.sglang_pool import SGLangPool
from moelora_peers.stubs._platform import cuda_capability, is_cuda
from moelora_peers.substitutes import sglang_slice_geometry


@dataclass(frozen=True)
class _Contract:
    lora_delta_dtype: torch.dtype


@dataclass(frozen=True)
class GeometryProvider:
    """A base-GEMM provider that carries only the geometry ``MoeLoraRunner.__init__`` reads (the base
    GEMMs are the caller's): H, I, E local experts, gate/up slices, the delta dtype."""

    hidden_size: int
    intermediate_size: int
    num_local_experts: int
    gate_up_slices: int
    contract: _Contract


@dataclass
class _Layer:
    """One layer forward's plan, launch config and routes (shared by its two stages)."""

    plan: object
    launch: object
    routes: object
    runner: object


class SGLangGroupedPath:
    """The plan-based stages on one spec (module docstring)."""

    def __init__(self, spec: LoRALayerSpec) -> None:
        self.spec = spec
        self.pool = SGLangPool(spec)
        self.plan_mod = sglang_modules.module("plan")
        self.routing = sglang_modules.module("routing")
        runner_mod = sglang_modules.module("runner")
        self.lora_b = sglang_modules.import_peer(sglang_modules.importer(), "sglang.kernels.ops.lora.moe.lora_b")
        if not is_cuda():
            sglang_slice_geometry.install(
                sglang_modules.import_peer(sglang_modules.importer(), "sglang.kernels.ops.lora.common.lora_b"))
        utils = sglang_modules.module("lora_utils")
        activation = sglang_modules.import_peer(sglang_modules.importer(),
                                                "sglang.kernels.ops.lora.moe.activation").ActivationFn
        cap = cuda_capability()
        self.architecture = utils.architecture_for_capability(cap[0]) if cap else "default"
        self.plans = self.plan_mod.resolve_plans(
            architecture=self.architecture, is_shared_outer=False, physical_rank=spec.R,
            activation=activation.SILU, hidden_size=spec.H, num_local_experts=spec.E, quant_family="bf16")
        self.Phase = utils.Phase
        provider = GeometryProvider(spec.H, spec.I, spec.E, 2, _Contract(spec.dtype))
        self.workspace_cls = sglang_modules.module("workspace").LoraWorkspace
        self._runners: dict[str | None, object] = {}
        self._make_runner = partial(runner_mod.MoeLoraRunner, providers={"expert_major": provider,
                                                                         "route_major": provider},
                                    top_k=spec.top_k, routed_scaling_factor=None, activation=activation.SILU,
                                    is_gated=True)

    def _runner(self, info: LoRABatchInfo):
        """One runner (and so one ``LoraWorkspace``) per graph family and one for eager batches."""
        key = info.private.get("family")
        runner = self._runners.get(key)
        if runner is None:
            runner = self._runners[key] = self._make_runner(workspace=self.workspace_cls())
        return runner

    def align(self, topk_ids: torch.Tensor, info: LoRABatchInfo) -> _Layer:
        """``build_moe_routes`` for the phase's plan (``MoeLoraRunner.run``'s first step)."""
        phase = self.Phase.DECODE if info.private["forward_mode"] is ForwardMode.DECODE else self.Phase.PREFILL
        selected = self.plans[phase]
        T = topk_ids.shape[0]
        launch = selected.tiles.config_for(T)
        runner = self._runner(info)
        runner.workspace.begin_forward(graph_mode=info.use_cuda_graph,
                                       is_prefill_graph=info.use_cuda_graph and phase is self.Phase.PREFILL)
        routes = self.routing.build_moe_routes(
            selected.plan, topk_ids=topk_ids, token_lora_mapping=info.token_lora_mapping,
            num_local_experts=self.spec.E, max_loras=self.spec.max_loras, block_size=launch.routing_block_size,
            workspace=runner.workspace)
        return _Layer(selected.plan, launch, routes, runner)

    def gate_up(self, x, topk_ids, gate_up_out, weights: LoRAWeights, info, layer: _Layer) -> None:
        b = self.pool.buffers(weights)
        p, pm = layer.plan, self.plan_mod
        dt = self.spec.dtype
        xs = x if x.dtype == dt else x.to(dt)
        rank = layer.runner._run_a(layer.launch, p.gate_up_a, xs, b.gate_up_a.flatten(0, 1), layer.routes,
                                   "gate_up_a")
        # b_activation plans own gate_up B inside the activation: run the standalone grouped B instead.
        spec_b = p.gate_up_b or pm.BSpec(pm.Site.GATE_UP, pm.BFamily.GROUPED, False, p.gate_up_a.output_layout)
        T, k = topk_ids.shape
        delta = torch.empty(T * k, 2 * self.spec.I, dtype=dt, device=x.device)
        layer.runner._run_b(layer.launch, spec_b, rank, b.gate_up_b.flatten(0, 1), delta, layer.routes,
                            slot_planes=p.gate_up_a.family is pm.AFamily.TOKEN_DENSE)
        gate_up_out.add_(delta.view(T, k, -1).to(gate_up_out.dtype))  # act_delta: g += dg before the act

    def down(self, h, topk_ids, topk_weights, down_out, weights: LoRAWeights, info, layer: _Layer) -> None:
        b = self.pool.buffers(weights)
        p = layer.plan
        dt = self.spec.dtype
        hs = h if h.dtype == dt else h.to(dt)
        T, k = topk_ids.shape
        rank = layer.runner._run_a(layer.launch, p.down_a, hs.view(-1, self.spec.I), b.down_a.flatten(0, 1),
                                   layer.routes, "down_a")
        if p.down_b_into_base:
            rows = torch.zeros(T * k, self.spec.H, dtype=dt, device=h.device)
            pair_to_row = torch.arange(T * k, dtype=torch.int32, device=h.device)
            self.lora_b.invoke_down_b_into_base(
                down_rows=rows, pair_to_row=pair_to_row, bridge=rank, b_down=b.down_b.flatten(0, 1),
                routing=layer.routes.aligned(p.down_b.is_shared_outer), config=layer.launch.for_b(p.down_b.site))
        else:
            rows = torch.empty(T * k, self.spec.H, dtype=dt, device=h.device)
            layer.runner._run_b(layer.launch, p.down_b, rank, b.down_b.flatten(0, 1), rows, layer.routes)
        # The finalize's router weighting of the delta (moelora's down_out is weighted already).
        weighted = rows.view(T, k, -1).float() * topk_weights.float()[..., None]
        down_out.add_(weighted.to(down_out.dtype))


def capabilities(device: torch.device | str = "cpu") -> Capabilities:
    """What the grouped path declares on ``device`` (conformance/docs/peers.md, "Capabilities").

    On CUDA the dtype SGLang's plan runner admits (``MoeLoraRunner._weight_family``: BF16 layers
    only); its stage kernels call ``tl.dot`` without ``input_precision`` (TF32 for fp32 operands on
    NVIDIA). Off CUDA (the Triton interpreter, IEEE dots) the dtype-generic stage kernels in fp32,
    fp16 and bf16. fp32 on CUDA only for the TF32 diagnostic (:func:`fp32_declared`).
    """
    if torch.device(device).type == "cuda":
        return peer_capabilities({torch.bfloat16} | ({torch.float32} if fp32_declared(device) else set()))
    return peer_capabilities({torch.float32, torch.float16, torch.bfloat16})


def make_path(spec: LoRALayerSpec) -> PeerPath:
    """The :class:`~moelora_peers.peer_backend.PeerPath` of the grouped path."""
    path = SGLangGroupedPath(spec)
    subs = {} if is_cuda() else {
        "common/lora_b.slice_geometry (CUDA tables)": "moelora_peers.substitutes.sglang_slice_geometry"}
    return PeerPath(
        peer="sglang", path="grouped", version=sglang_modules.importer().dist.version,
        capabilities=capabilities(spec.device),
        on_slot_loaded=path.pool.on_slot_loaded, align=path.align, gate_up=path.gate_up, down=path.down,
        dense=partial(csgmv_dense_delta, path.pool), cpu_substitutes=subs,
    )
