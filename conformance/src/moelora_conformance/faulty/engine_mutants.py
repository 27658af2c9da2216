"""Engine-level faults: each class below is ``moelora_runner.Engine`` with one known fault of the
public serving trackers put back into one of its components (the pool, the step's batch, a graph
runner). The engine is composed through its public ``parts=`` argument (``moelora_runner.EngineParts``)
with a faulty subclass of that component, which works through the component's public methods
(``AdapterPool.acquire`` / ``pin`` / ``register``, ``ModelRunner.plan``, the runner's constructor and
its graph runners' static batch) — never through a switch or a hook in the production code.

They are not layer backends: the layer suite cannot load them. The stateful engine properties catch
them (``moelora_conformance.e2e.stateful.run_state_machine(engine_class=...)``;
``conformance/tests/test_mutations_engine.py``; the table in ``docs/mutations.md``).

Needs ``moelora_runner`` (imported here at module level: import this module only where the engine is
installed).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, replace

from moelora_conformance.faulty.mutants import _StaleTailBuffer
from moelora_core.batch import BatchSpec, Request
from moelora_runner.adapter_pool import AdapterPool
from moelora_runner.engine import Engine, EngineParts
from moelora_runner.graph_config import GraphConfig
from moelora_runner.model_runner import ModelRunner, StepPlan


class _FaultyEngine(Engine):
    """``Engine`` built with :attr:`parts` (its public ``parts=`` argument); every other argument as given."""

    parts: EngineParts

    def __init__(self, model_dir, **kwargs) -> None:
        super().__init__(model_dir, parts=self.parts, **kwargs)


class _PoolWithoutZeroing(AdapterPool):
    """Every public method that may load a slot (a load on demand, a pin, a reload) runs with the layers'
    ``LoRAWeights.clear_slot`` a no-op; ``unregister`` still zeroes."""

    @contextmanager
    def _loads_without_zeroing(self):
        # FAULT: a reused slot is not zeroed before the new adapter is written into it.
        for pool in self.pools:
            pool.clear_slot = lambda slot: None
        try:
            yield
        finally:
            for pool in self.pools:
                del pool.clear_slot

    def acquire(self, name):
        with self._loads_without_zeroing():
            return super().acquire(name)

    def pin(self, name):
        with self._loads_without_zeroing():
            return super().pin(name)

    def register(self, name, path):
        with self._loads_without_zeroing():
            return super().register(name, path)

    def register_tensors(self, name, tensors, config):
        with self._loads_without_zeroing():
            return super().register_tensors(name, tensors, config)


class PoolSkipsZeroing(_FaultyEngine):
    """The adapter pool does not zero a reused slot: an adapter loaded into a slot (an eviction, a
    reload) over one with modules it lacks (or larger ranks) is served with the old adapter's left-over
    modules and rank tails."""

    parts = EngineParts(adapter_pool=_PoolWithoutZeroing)


class _OneMappingRunner(ModelRunner):
    def plan(self, batch) -> StepPlan:
        plan = super().plan(batch)
        items = batch.items
        chunks = [i for i, item in enumerate(items) if not item.state.is_decoding]
        if not chunks or len(chunks) == len(items):
            return plan
        spec = plan.host.batch_spec
        slot = spec.requests[chunks[0]].slot
        # FAULT: the decodes take the prefill chunk's slot.
        requests = [
            r if i in chunks else Request(slot, r.extend_len, r.prefix_len) for i, r in enumerate(spec.requests)
        ]
        new = BatchSpec(spec.forward_mode, requests, spec.max_loras, spec.lora_ranks, spec.scalings)
        return StepPlan(plan.batch, replace(plan.host, batch_spec=new), plan.rows)


class MixedBatchOneMapping(_FaultyEngine):
    """The step's batch merges a prefill chunk's adapter mapping with the decodes': in a step mixing a
    prefill chunk and decodes, every decode's tokens are mapped to the chunk's adapter slot."""

    parts = EngineParts(model_runner=_OneMappingRunner)


class _StaleDecodeTailRunner(ModelRunner):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.decode_graph is not None:
            static = self.decode_graph.static
            # FAULT: the decode family's static batch keeps the previous (larger) batch's rows in its tails.
            for name, old in list(static.buffers.items()):
                static.buffers[name] = _StaleTailBuffer(
                    old.name, old.capacity, dtype=old.tensor.dtype, device=old.tensor.device, fill=old.fill
                )


class DecodeBucketTailKept(_FaultyEngine):
    """The decode graph's static batch is not reset past the live rows: a smaller batch replayed in a
    bucket after a larger one runs its pad rows on the larger batch's tokens, positions and KV
    locations, so they write K/V (without that request's LoRA) into another request's cache."""

    parts = EngineParts(model_runner=_StaleDecodeTailRunner)


class _Capped32(GraphConfig):
    def prefill_requests(self, tokens: int) -> int:
        return min(32, super().prefill_requests(tokens))  # FAULT: SGLang's old fixed 32-request table


class _Capped32Runner(ModelRunner):
    def __init__(self, *args, graphs=None, **kwargs) -> None:
        super().__init__(*args, graphs=None if graphs is None else _Capped32(**asdict(graphs)), **kwargs)


class PrefillGraph32Requests(_FaultyEngine):
    """The prefill graph is captured with at most 32 request slots (the old fixed cap): a prefill step of
    33 or more requests that fits the configured ``max_num_requests`` runs eagerly instead of on the
    graph."""

    parts = EngineParts(model_runner=_Capped32Runner)


#: name → engine class of every engine-level fault.
ENGINE_MUTANTS: dict[str, type[Engine]] = {
    "pool-skips-zeroing": PoolSkipsZeroing,
    "mixed-batch-one-mapping": MixedBatchOneMapping,
    "decode-bucket-tail-kept": DecodeBucketTailKept,
    "prefill-graph-32-requests": PrefillGraph32Requests,
}

#: The named E06 history (``e2e.stateful_histories``) of each engine mutant's fault class.
CAUGHT_BY_HISTORY: dict[str, str] = {
    "pool-skips-zeroing": "evicted-slot-reused",
    "mixed-batch-one-mapping": "chunked-prefill-interleaved",
    "decode-bucket-tail-kept": "decode-batch-shrinks-in-a-bucket",
    "prefill-graph-32-requests": "prefill-past-32-requests",
}
