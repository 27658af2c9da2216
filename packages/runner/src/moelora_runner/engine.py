"""The offline engine: a checkpoint, an adapter pool, a scheduler, a KV cache and a model runner,
behind a small Python API (what the CLI, the graph runners, the e2e and TP work build on).

    engine = Engine("models/qwen3_moe", backend="reference", max_loras=4, max_lora_rank=16)
    engine.load_adapter("math", "adapters/math")          # read + validated now; a slot on demand
    outputs = engine.generate([{"prompt_token_ids": [5, 9, 2], "adapter": "math", "max_new_tokens": 8},
                               {"prompt_token_ids": [7, 3], "max_new_tokens": 8}])

``step()`` runs one scheduler step (one forward) and returns the requests that finished in it;
``generate`` adds requests, steps until they are done and returns their outputs in input order
(a request refused at ``add_request`` gets an output with finish reason "error", the others run).

Decisions (DESIGN.md §6 leaves them open):

- Reloading (``load_adapter`` of a registered name) or unloading an adapter that a running or
  waiting request uses is refused with ``AdapterInUseError``; once free, a reload writes the new
  weights into the adapter's slot and every later request is served with them.
- A request reserves its whole KV span (prompt + ``max_new_tokens``, capped at the context) when it
  is admitted; requests that do not fit wait (first come, first served) and one that could never
  fit is refused at ``add_request`` with ``PromptTooLongError``.
- Generation stops at the model's context (``max_position_embeddings``): finish reason "length".
- A backend that declares ``fused_moe`` (the reference backend) runs its own MoE forward; the
  ``moe_impl`` choice applies to the others.
- Graphs (``graph``, ``decode_graph`` and the bucket arguments, :mod:`.graph_config`): on CUDA the
  prefill ``full`` graph and the decode graph by default, every bucket captured at start-up; on the
  CPU everything eager unless asked, buckets captured on first use on the emulator.
- Tensor / expert parallelism (``tp``, ``ep``; :mod:`.parallel`): one Engine per rank, in a running
  ``torch.distributed`` group of ``max(tp, ep)`` ranks (torchrun's, or the workers of
  :mod:`.parallel.launch`). Every rank runs the same scheduler on the same requests (SPMD) over its
  slice of the model, its adapters' slices and its own KV heads; the all-reduces inside the model
  leave every rank with the same hidden states, so every rank samples the same tokens. Each rank
  captures its own graphs, with the collectives inside.
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from moelora_core.backend import check_base_quant_served, check_protocol, load_backend
from moelora_core.checkpoint import AdapterEffect, AdapterWarning, adapter_effect, read_checkpoint
from moelora_core.errors import MoeLoraError
from moelora_core.layer_spec import EXPERT_LAYOUTS
from moelora_core.weights import LoRAWeights
from moelora_runner.adapter_pool import AdapterPool
from moelora_runner.errors import (
    DuplicateRequestIdError,
    EngineConfigError,
    GenerateInterrupted,
    InvalidRequestError,
    PromptTooLongError,
)
from moelora_runner.graph_config import resolve_graph_config
from moelora_runner.kv_cache import KVCache
from moelora_runner.metrics import EngineMetrics
from moelora_runner.model import MoEDecoder
from moelora_runner.model_info import ModelInfo
from moelora_runner.model_runner import PHASES, ModelRunner
from moelora_runner.moe_paths import MOE_IMPLS, base_moe_path
from moelora_runner.parallel.layout import ParallelLayout
from moelora_runner.parallel.sharding import local_layer_spec, shard_adapter
from moelora_runner.requests import EngineRequest, RequestOutput
from moelora_runner.sampler import sample_token, top_logprobs
from moelora_runner.scheduler import Scheduler
from moelora_runner.sequence import RequestState
from moelora_runner.tokenizer import CheckpointTokenizer

#: Built-in backends made of Triton kernels (on a CPU they run under the interpreter).
TRITON_BACKENDS = frozenset({"triton", "csgmv"})
#: ``dtype=`` names.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EngineConfigError(name, f"must be an int >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class EngineParts:
    """What an engine builds its adapter pool and its model runner with (``Engine(..., parts=)``):
    callables with the signature of :class:`~.adapter_pool.AdapterPool` and
    :class:`~.model_runner.ModelRunner`, called with what the engine passes the classes. The defaults
    are the classes (what the CLI serves); a subclass of one composes an engine with another
    component through that component's public methods — the suite's engine-level faulty variants
    (``moelora_conformance.faulty.engine_mutants``) are built so. The scheduler is not a part: nothing
    replaces it (DESIGN.md §6).

    Attributes:
        adapter_pool: ``(pools, backend, model_config, *, on_event, shard, inspect) -> AdapterPool``.
        model_runner: ``(model, backend, adapters, kv, device, *, check_host_sync, on_pass, graphs)
            -> ModelRunner``.
    """

    adapter_pool: Callable[..., AdapterPool] = AdapterPool
    model_runner: Callable[..., ModelRunner] = ModelRunner


class Engine:
    """An offline multi-LoRA MoE engine on one device (see the module doc).

    Args:
        model_dir: a Hugging Face checkpoint directory (Qwen3-MoE, Mixtral, OLMoE).
        backend: "reference", "triton", "csgmv" or "module:factory" (``moelora_core.load_backend``).
        dtype: "auto" (the checkpoint's dtype; float32 when it names none), "float32", "float16",
            "bfloat16".
        device: "cpu" or "cuda[:N]".
        max_loras: adapter slots. max_lora_rank: the pool's rank R (larger adapters are refused).
        max_loras_per_batch: distinct adapters among running requests (default ``max_loras``).
        max_num_batched_tokens: the per-step token budget (chunked prefill).
        kv_cache_tokens: KV cache locations (the token budget of all running requests together).
        moe_impl: "torch" or "triton" base MoE path (default: torch on the CPU, triton on CUDA).
        max_num_seqs: requests running at once (rows of the KV table).
        check_host_sync: run every forward under ``moelora_core.graphs.host_sync_guard``.
        graph: the prefill mode, "eager", "full" or "breakable" (None: "full" on CUDA when the
            backend declares it, else "eager").
        decode_graph: the decode graph on or off (None: on on CUDA when the backend declares it).
        max_num_requests: request slots of the prefill graph (default 64).
        prefill_token_buckets, decode_batch_buckets: bucket sizes (ints or a comma list; defaults in
            :mod:`.graph_config`).
        graph_capture: "startup" (every bucket when the engine starts; CUDA's default) or "lazy" (a
            bucket on its first use; the CPU's default).
        expert_layout: which expert factors the adapter pool stores once per slot
            (``moelora_core.EXPERT_LAYOUTS``): "per_expert" (default; any adapter fits, a shared factor
            is broadcast), "shared_outer" (gate_up A and down B once per slot: shared-outer and fully
            shared adapters fit, per-expert ones are refused with ``ExpertLayoutError``) or
            "fully_shared" (every factor once per slot). Needs a backend declaring
            ``shared_expert_factors`` unless "per_expert".
        tp, ep: tensor- and expert-parallel sizes (:mod:`.parallel.layout` lists the supported
            combinations); above 1, ``torch.distributed`` must run ``max(tp, ep)`` ranks and this
            engine is the one of this process's rank (device "cuda" then means ``cuda:<rank>``).
        parts: the callables the adapter pool and the model runner are built with (:class:`EngineParts`;
            None: the classes themselves, as the CLI serves).

    Raises:
        EngineConfigError: an argument out of range, a dtype / device / rank the backend does not
            declare, the Triton path on a CPU without ``TRITON_INTERPRET=1``, bf16 Triton kernels on
            a CPU (the interpreter computes bf16 wrongly), a graph mode or family the backend does
            not declare, bad buckets; an unsupported (tp, ep), a size that does not divide the
            model's heads / kv heads / I / experts (with the numbers), tp or ep above 1 without a
            ``torch.distributed`` group of that size.
        GraphCaptureError: a start-up capture the backend answers with ``Fallback`` or
            ``has_active_lora`` False.
        CheckpointError (and subclasses): the checkpoint cannot be read.
        InvalidFieldError: an unknown backend name.
    """

    def __init__(self, model_dir: str | Path, *, backend: str = "reference", dtype: str = "auto",
                 device: str | torch.device = "cpu", max_loras: int = 4, max_lora_rank: int = 64,
                 max_loras_per_batch: int | None = None, max_num_batched_tokens: int = 2048,
                 kv_cache_tokens: int = 8192, moe_impl: str | None = None, max_num_seqs: int = 256,
                 check_host_sync: bool = False, graph: str | None = None, decode_graph: bool | None = None,
                 max_num_requests: int | None = None, prefill_token_buckets=None, decode_batch_buckets=None,
                 graph_capture: str | None = None, tp: int = 1, ep: int = 1,
                 expert_layout: str = "per_expert", parts: EngineParts | None = None) -> None:
        parts = parts or EngineParts()
        self.model_dir = Path(model_dir)
        layout = ParallelLayout(tp, ep)  # the sizes and their combination; the rank once the group is joined
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank),
                            ("max_num_batched_tokens", max_num_batched_tokens), ("kv_cache_tokens", kv_cache_tokens),
                            ("max_num_seqs", max_num_seqs)):
            _positive(name, value)
        per_batch = max_loras if max_loras_per_batch is None else _positive("max_loras_per_batch",
                                                                             max_loras_per_batch)
        if per_batch > max_loras:
            raise EngineConfigError("max_loras_per_batch", f"{per_batch} > max_loras {max_loras}: a batch cannot "
                                    "use more adapters than there are slots")
        self.info = ModelInfo.read(self.model_dir)
        config = self.info.config
        layout.check(config)
        self.parallel, comm = self._join_group(layout)
        device = torch.device(device)
        if device.type == "cuda" and device.index is None and self.parallel.parallel:
            device = torch.device("cuda", self.parallel.rank % torch.cuda.device_count())
        self.device = device
        self.dtype = self._resolve_dtype(dtype, config.torch_dtype)
        self.moe_impl = self._resolve_moe_impl(moe_impl)
        self.backend_name = backend
        # At one rank the whole layer; else this rank's slice (local I, experts, q/k/v/o widths).
        spec = local_layer_spec(config, self.parallel, max_loras=max_loras, max_rank=max_lora_rank,
                                dtype=self.dtype, device=self.device) if self.parallel.parallel else \
            config.layer_spec(max_loras=max_loras, max_rank=max_lora_rank, dtype=self.dtype, device=self.device)
        if expert_layout not in EXPERT_LAYOUTS:
            raise EngineConfigError("expert_layout", f"must be one of {tuple(EXPERT_LAYOUTS)}, got {expert_layout!r}")
        spec = replace(spec, expert_layout=expert_layout)
        self.expert_layout = expert_layout
        factory = load_backend(backend)
        # One backend instance per engine (per device and TP rank): the eager passes and every graph
        # bucket of both families (DESIGN.md §6).
        self.backend = factory(spec)
        check_protocol(self.backend)
        caps = self.backend.capabilities()
        # Before any weight is read: a backend that does not declare the model's base quantization
        # would drop or mis-scale deltas on that path (DESIGN.md §1, "Quantized base").
        check_base_quant_served(backend, caps, spec.base_quant)
        if spec.base_quant != "none" and self.parallel.parallel:
            raise EngineConfigError("tp", f"{self.model_dir} is an fp8 block-scaled checkpoint: TP / EP shard no "
                                    "block scales (serve it at tp=1, ep=1)")
        self.base_quant, self.weight_block = spec.base_quant, config.weight_block
        if expert_layout != "per_expert" and not caps.shared_expert_factors:
            raise EngineConfigError("expert_layout", f"backend {backend!r} does not declare shared_expert_factors: "
                                    f"it cannot read expert factors stored once per slot ({expert_layout!r})")
        if self.dtype not in caps.dtypes:
            raise EngineConfigError("dtype", f"backend {backend!r} does not compute in {self.dtype} "
                                    f"(it declares {sorted(str(d) for d in caps.dtypes)})")
        if self.device.type not in caps.devices:
            raise EngineConfigError("device", f"backend {backend!r} does not run on {self.device.type!r} (it declares "
                                    f"{sorted(caps.devices)}; Triton backends run on a CPU only under "
                                    "TRITON_INTERPRET=1)")
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and \
                (self.moe_impl == "triton" or backend in TRITON_BACKENDS):
            raise EngineConfigError("dtype", "bfloat16 Triton kernels compute wrongly under the Triton interpreter "
                                    "on a CPU; use float32 / float16 there, or the reference backend with "
                                    "moe_impl='torch'")
        if caps.max_rank is not None and max_lora_rank > caps.max_rank:
            raise EngineConfigError("max_lora_rank",
                                    f"{max_lora_rank} > backend {backend!r}'s max rank {caps.max_rank}")
        self.graphs = resolve_graph_config(
            device=self.device, caps=caps, backend=backend, graph=graph, decode_graph=decode_graph,
            max_num_requests=max_num_requests, prefill_token_buckets=prefill_token_buckets,
            decode_batch_buckets=decode_batch_buckets, max_num_batched_tokens=max_num_batched_tokens,
            max_bs=max_num_seqs, capture=graph_capture)

        self.metrics_ = EngineMetrics()
        weights = read_checkpoint(self.model_dir, dtype=self.dtype)
        self.model = MoEDecoder(weights, dtype=self.dtype, device=self.device, max_positions=self.info.max_context,
                                sliding_window=self.info.sliding_window, moe_path=base_moe_path(self.moe_impl),
                                parallel=self.parallel, comm=comm)
        del weights
        pools = [LoRAWeights(spec) for _ in range(config.num_layers)]
        layout = self.parallel
        shard = (lambda w: shard_adapter(w, config, layout)) if layout.parallel else None
        # The no-op probe needs the whole base weights: one rank holds a shard of them, so parallel
        # engines run the exact-zero tests only (moelora_core.checkpoint.adapter_effect).
        # An fp8 base (weights as codes plus scales) too: its probe would read the codes as weights.
        base = None if layout.parallel or spec.base_quant != "none" else [layer.w for layer in self.model.layers]
        self.adapters = parts.adapter_pool(
            pools, self.backend, config, on_event=self.metrics_.adapter_event, shard=shard,
            inspect=lambda w: adapter_effect(w, base, dtype=self.dtype, device=self.device))
        self.kv = KVCache(num_layers=config.num_layers, num_kv_heads=layout.heads(config)[1],
                          head_dim=config.head_dim, num_tokens=kv_cache_tokens, max_requests=max_num_seqs,
                          max_context=min(self.info.max_context, kv_cache_tokens), dtype=self.dtype,
                          device=self.device)
        self.scheduler = Scheduler(self.kv, self.adapters, max_num_batched_tokens=max_num_batched_tokens,
                                   max_loras_per_batch=per_batch, max_running=max_num_seqs,
                                   max_batch_requests=caps.max_requests)
        self.runner = parts.model_runner(self.model, self.backend, self.adapters, self.kv, self.device,
                                         check_host_sync=check_host_sync, on_pass=self.metrics_.forward_pass,
                                         graphs=self.graphs)
        if self.graphs.capture == "startup":
            self.runner.capture_all()
        self.tokenizer = CheckpointTokenizer(self.model_dir)
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_loras_per_batch = per_batch
        self.max_num_batched_tokens = max_num_batched_tokens
        self._ids = itertools.count()
        self._active: dict[str, RequestState] = {}
        self._unclaimed: list[RequestOutput] = []

    # --- configuration -------------------------------------------------------------------------

    @staticmethod
    def _join_group(layout: ParallelLayout):
        """(this rank's layout, its collectives) in the running process group; (layout, None) at one rank."""
        tp, ep = layout.tp, layout.ep
        if not layout.parallel:
            return layout, None
        import torch.distributed as dist

        from moelora_runner.parallel.comm import Collectives, register

        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() != layout.world:
            running = f"{dist.get_world_size()} ranks" if dist.is_available() and dist.is_initialized() else "none"
            raise EngineConfigError("tp" if tp > 1 else "ep",
                                    f"tp={tp} ep={ep} needs a torch.distributed group of {layout.world} ranks "
                                    f"(running: {running}); start under torchrun, through `moelora generate "
                                    f"--tp/--ep` or moelora_runner.parallel.launch")
        return ParallelLayout(tp, ep, dist.get_rank()), Collectives(register("world", None), layout.world)

    def _resolve_dtype(self, dtype: str, stored: str | None) -> torch.dtype:
        if dtype == "auto":
            return DTYPES.get(stored or "float32", torch.float32)
        if dtype not in DTYPES:
            raise EngineConfigError("dtype", f"must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]

    def _resolve_moe_impl(self, moe_impl: str | None) -> str:
        impl = moe_impl or ("triton" if self.device.type == "cuda" else "torch")
        if impl not in MOE_IMPLS:
            raise EngineConfigError("moe_impl", f"must be one of {MOE_IMPLS}, got {impl!r}")
        if impl == "triton" and self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise EngineConfigError("moe_impl", "the Triton MoE path runs on a CPU only under TRITON_INTERPRET=1 "
                                    "(set it before starting); use moe_impl='torch'")
        return impl

    @property
    def metrics(self):
        """The engine's ``prometheus_client.CollectorRegistry`` (see :mod:`moelora_runner.metrics`)."""
        return self.metrics_.registry

    def sizing(self) -> dict[str, int]:
        """Bytes and counts for the start-up line: model, KV cache, one adapter slot."""
        return {"model_bytes": self.model.bytes(), "kv_cache_tokens": self.kv.num_tokens,
                "kv_cache_bytes": self.kv.bytes(), "kv_bytes_per_token": self.kv.bytes_per_token(),
                "adapter_slot_bytes": self.adapters.slot_bytes(), "max_loras": self.max_loras,
                "max_lora_rank": self.max_lora_rank, "tp": self.parallel.tp, "ep": self.parallel.ep}

    # --- adapters ------------------------------------------------------------------------------

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Register the PEFT adapter at ``path`` as ``name`` (read and validated now; a slot is filled on
        demand). A registered name is reloaded: the new weights serve every later request.

        A no-op adapter (every module's lora_B or lora_A exactly zero, or its delta on the probe within
        the dtype's tolerance: ``moelora_core.checkpoint.adapter_effect``) is served, with an
        ``AdapterWarning`` naming it; so are the reader's notes on its config (:meth:`adapter_warnings`).

        Raises:
            the checkpoint reader's refusals (``moelora_core.checkpoint.ADAPTER_REFUSALS``): nothing changed.
            AdapterInUseError: reload of an adapter a running or waiting request uses.
        """
        self._warn(self.adapters.register(name, path))

    def load_adapter_from_tensors(self, name: str, tensors: Mapping[str, torch.Tensor], config: Any) -> None:
        """Register an adapter from in-memory PEFT tensors and its config (RL weight sync); the same
        validation, refusals and warnings as :meth:`load_adapter` (see ``AdapterPool.register_tensors``)."""
        self._warn(self.adapters.register_tensors(name, tensors, config))

    @staticmethod
    def _warn(entry) -> None:
        for message in entry.effect.warnings() if entry.effect is not None else ():
            warnings.warn(message, AdapterWarning, stacklevel=3)

    def adapter_effect(self, name: str) -> AdapterEffect | None:
        """What registered adapter ``name`` changes: per module its delta on the probe, the no-op verdict
        (None only for an entry a custom adapter pool registered without measuring it).

        Raises:
            UnknownAdapterError: not registered.
        """
        return self.adapters.get(name).effect

    def adapter_warnings(self, name: str) -> tuple[str, ...]:
        """The warnings :meth:`load_adapter` issued for ``name`` (empty for an adapter that changes every
        module it holds and whose config the reader served as written)."""
        effect = self.adapter_effect(name)
        return () if effect is None else effect.warnings()

    def unload_adapter(self, name: str) -> None:
        """Forget ``name`` and zero its slot.

        Raises:
            UnknownAdapterError, AdapterInUseError, AdapterPinnedError.
        """
        self.adapters.unregister(name)

    def pin(self, name: str) -> None:
        """Load ``name`` into a slot now and never evict it until :meth:`unpin`.

        Raises:
            UnknownAdapterError, NoFreeSlotError.
        """
        self.adapters.pin(name)

    def unpin(self, name: str) -> None:
        self.adapters.unpin(name)

    # --- requests ------------------------------------------------------------------------------

    def _state(self, request: EngineRequest | Mapping[str, Any]) -> RequestState:
        req = request if isinstance(request, EngineRequest) else EngineRequest.from_dict(request)
        req.validate()
        rid = req.request_id if req.request_id is not None else f"req-{next(self._ids)}"
        if rid in self._active:
            raise InvalidRequestError(f"request {rid!r} request_id", "is already used by an unfinished request")
        prompt = list(req.prompt_token_ids) if req.prompt is None else self.tokenizer.encode(req.prompt, request_id=rid)
        if not prompt:
            raise InvalidRequestError(f"request {rid!r} prompt", "tokenizes to no tokens")
        vocab = self.info.config.vocab_size
        for field, ids in (("prompt_token_ids", prompt), ("stop_token_ids", req.stop_token_ids)):
            for i, t in enumerate(ids):
                if not 0 <= t < vocab:
                    raise InvalidRequestError(f"request {rid!r} {field}[{i}]",
                                              f"token id {t} is outside the vocabulary [0, {vocab})")
        if req.adapter is not None:
            self.adapters.get(req.adapter)
        ctx = self.info.max_context
        if len(prompt) > ctx:
            raise PromptTooLongError(f"request {rid!r} prompt_token_ids",
                                     f"{len(prompt)} tokens are longer than the model's context of {ctx} tokens")
        max_new = min(req.max_new_tokens, ctx - len(prompt))
        reserve = len(prompt) + max_new
        if reserve > self.kv.max_context:
            raise PromptTooLongError(f"request {rid!r} max_new_tokens",
                                     f"prompt ({len(prompt)}) + max_new_tokens ({max_new}) = {reserve} tokens of KV "
                                     f"can never fit the KV cache of {self.kv.num_tokens} tokens")
        state = RequestState(request=req, request_id=rid, prompt=prompt, reserve=reserve, max_new=max_new)
        if max_new < req.max_new_tokens:
            state.output.warnings.append(
                f"max_new_tokens {req.max_new_tokens} capped to {max_new}: the prompt's {len(prompt)} tokens leave "
                f"{max_new} of the model's context of {ctx} tokens")
        return state

    def add_request(self, request: EngineRequest | Mapping[str, Any]) -> str:
        """Validate and queue one request (an :class:`EngineRequest` or a request-file dict).

        Returns:
            The request id.

        Raises:
            InvalidRequestError, PromptTooLongError, UnknownAdapterError: nothing was queued.
        """
        state = self._state(request)
        self.scheduler.add(state)
        self._active[state.request_id] = state
        self._update_gauges()
        return state.request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step and return the requests that finished in it (any order).

        A step with nothing to run is valid: it launches nothing and returns what is pending.
        """
        start = time.perf_counter()
        finished, self._unclaimed = self._unclaimed, []
        batch = self.scheduler.schedule()
        for state, exc in batch.failed:
            finished.append(self._finish_failed(state, exc))
        for item in batch.items:
            if item.state.first_scheduled is None:
                item.state.first_scheduled = start
        plan = self.runner.plan(batch)
        logits = self.runner.forward(plan)
        logprobs = torch.log_softmax(logits, dim=-1)
        prompt_tokens = generated = 0
        for item, rows in zip(batch.items, plan.rows):
            st = item.state
            prompt_tokens += max(0, min(st.num_computed + item.num_tokens, len(st.prompt)) - st.num_computed)
            st.num_computed += item.num_tokens
            for row, i in rows.prompt_rows:
                st.output.prompt_logprobs[i] = float(logprobs[row, st.prompt[i]])
            reason = None
            if rows.sample_row is not None:
                token = sample_token(logits[rows.sample_row], st.request, st.generator)
                self._append(st, token, logprobs[rows.sample_row])
                generated += 1
                reason = self._stop_reason(st, token)
            elif st.max_new == 0 and st.num_computed == len(st.prompt):
                reason = "length"
            if reason is not None:
                finished.append(self._finish(st, reason))
        m = self.metrics_
        m.tokens.labels(kind="prompt").inc(prompt_tokens)
        m.tokens.labels(kind="output").inc(generated)
        m.step_latency.labels(phase=PHASES[plan.host.forward_mode.value]).observe(time.perf_counter() - start)
        self._update_gauges()
        return finished

    def generate(self, requests: Iterable[EngineRequest | Mapping[str, Any]], *,
                 on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Run ``requests`` to completion; their outputs in input order.

        A request refused by :meth:`add_request` gets an output with finish reason "error" and
        ``error = {"type", "message"}``; the others run. Outputs of requests added earlier that
        finish meanwhile are kept for the next :meth:`step`.

        Args:
            requests: :class:`EngineRequest` objects or request-file dicts.
            on_output: called with each of these requests' outputs as it finishes (refused ones
                first), e.g. to drive a progress bar.

        Raises:
            DuplicateRequestIdError: two of ``requests`` share a ``request_id`` (nothing was queued).
            GenerateInterrupted: a ``KeyboardInterrupt`` (Ctrl-C) arrived; it carries the outputs of
                the requests that had finished. The unfinished ones stay queued on the engine.
        """
        requests = list(requests)
        _refuse_duplicate_ids(requests)
        notify = on_output or (lambda out: None)
        order: list[str | RequestOutput] = []
        done: dict[str, RequestOutput] = {}
        try:
            for request in requests:
                try:
                    order.append(self.add_request(request))
                except MoeLoraError as exc:
                    order.append(RequestOutput.refused(request, exc, default_id=f"req-{next(self._ids)}"))
                    self.metrics_.requests_finished.labels(finish_reason="error").inc()
                    notify(order[-1])
            wanted = {r for r in order if isinstance(r, str)}
            while wanted - done.keys():
                for out in self.step():
                    if out.request_id in wanted:
                        done[out.request_id] = out
                        notify(out)
                    else:
                        self._unclaimed.append(out)
        except KeyboardInterrupt as exc:
            outputs = [done.get(r) if isinstance(r, str) else r for r in order]
            raise GenerateInterrupted(outputs + [None] * (len(requests) - len(order))) from exc
        return [done[r] if isinstance(r, str) else r for r in order]

    # --- bookkeeping ---------------------------------------------------------------------------

    def _append(self, st: RequestState, token: int, logprobs: torch.Tensor) -> None:
        out = st.output
        out.output_token_ids.append(token)
        out.output_logprobs.append(float(logprobs[token]))
        if out.top_logprobs is not None:
            out.top_logprobs.append(top_logprobs(logprobs, st.request.logprobs))
        if st.first_token is None:
            st.first_token = time.perf_counter()

    def _stop_reason(self, st: RequestState, token: int) -> str | None:
        req = st.request
        if token in req.stop_token_ids or (not req.ignore_eos and token in self.info.eos_token_ids):
            return "stop"
        if st.num_generated >= st.max_new:
            return "length"
        return None

    def _timings(self, st: RequestState) -> dict[str, float | None]:
        now = time.perf_counter()
        return {"queued": None if st.first_scheduled is None else st.first_scheduled - st.arrival,
                "ttft": None if st.first_token is None else st.first_token - st.arrival,
                "e2e": now - st.arrival}

    def _finish(self, st: RequestState, reason: str) -> RequestOutput:
        self.scheduler.finish(st)
        del self._active[st.request_id]
        st.output.finish_reason = reason
        st.output.timings = self._timings(st)
        self.metrics_.requests_finished.labels(finish_reason=reason).inc()
        return st.output

    def _finish_failed(self, st: RequestState, exc: Exception) -> RequestOutput:
        del self._active[st.request_id]
        out = RequestOutput.failed(st.request_id, st.adapter, exc, st.prompt)
        out.timings = self._timings(st)
        self.metrics_.requests_finished.labels(finish_reason="error").inc()
        return out

    def _update_gauges(self) -> None:
        m = self.metrics_
        m.running.set(len(self.scheduler.running))
        m.waiting.set(len(self.scheduler.waiting))
        m.kv_used.set(self.kv.used_tokens)


def _refuse_duplicate_ids(requests: list) -> None:
    """Raise :class:`DuplicateRequestIdError` naming the first ``request_id`` given twice (by position)."""
    seen: dict[str, int] = {}
    for i, request in enumerate(requests):
        rid = request.request_id if isinstance(request, EngineRequest) else (
            request.get("request_id") if isinstance(request, Mapping) else None)
        if not isinstance(rid, str):
            continue
        if rid in seen:
            raise DuplicateRequestIdError(f"request {rid!r} request_id",
                                          f"is given twice (requests {seen[rid]} and {i}, counting from 0): each "
                                          "request needs its own id; nothing was queued")
        seen[rid] = i
