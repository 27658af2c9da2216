"""Named histories of the E06 state machine: one per public engine-level fault class, each an explicit
sequence of the machine's rules (with its invariants checked after every rule and its teardown at
the end) — the state machine's ``@example``s, which Hypothesis does not offer for state machines.

The production engine passes every history (``packages/runner/tests/test_engine_state_machine.py``);
each engine-level faulty variant fails the history of its fault class
(``conformance/tests/test_mutations_engine.py``).

Adapters are indexed as given to :func:`run_history`: index 0 must have MoE and attention modules,
index 3 must lack some module index 0 has (so a slot reused from 0 to 3 shows left-overs), index 4 is
the one not registered at the start. The runner's engine adapters and the fixtures' ``qwen3_moe``
adapters both fit (the tests pass them in that order).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from moelora_conformance.e2e.stateful import MachineConfig, machine_class, pool_rank


@dataclass(frozen=True)
class History:
    """One named history: the fault class it pins, the engine it runs on, its rules."""

    fault: str
    mode: str
    max_loras: int
    run: Callable[[object], None]


def _do(machine, rule: str, **kwargs) -> None:
    getattr(machine, rule)(**kwargs)
    machine.slots_hold_exactly_their_adapters()


def _index(machine, adapter: int) -> int:
    """The rules' index (into the sorted registered names) of adapter ``adapter``."""
    return sorted(machine.version).index(machine.names[adapter])


def _start(machine, *, per_batch=3, budget=64, kv_tokens=512) -> None:
    machine.start(per_batch=per_batch, budget=budget, kv_tokens=kv_tokens, mode=machine.config.mode)
    machine.slots_hold_exactly_their_adapters()


def _evicted_slot_reused(m) -> None:
    # Two slots: adapters 0 and 1 fill them; adapter 3 (fewer modules) then evicts 0, the least
    # recently used, and must be served with its own modules only.
    _start(m)
    _do(m, "add_request", adapter=0, length=6, max_new=3, seed=1, sampled=False, ignore_eos=True)
    _do(m, "add_request", adapter=1, length=4, max_new=3, seed=2, sampled=False, ignore_eos=True)
    _do(m, "step", n=4)
    _do(m, "add_request", adapter=3, length=5, max_new=3, seed=3, sampled=False, ignore_eos=True)
    _do(m, "step", n=4)


def _hot_load_during_decode(m) -> None:
    # A tenant decodes while another adapter is loaded (a new name) and a third is reloaded (new
    # weights under its name, not in use); the reload of the decoding tenant's adapter is refused.
    _start(m)
    _do(m, "add_request", adapter=0, length=3, max_new=5, seed=4, sampled=False, ignore_eos=True)
    _do(m, "step", n=2)
    _do(m, "load", i=0)  # adapter 4: the one not registered yet
    _do(m, "reload", i=_index(m, 2))  # not in use: new weights now
    _do(m, "add_request", adapter=4, length=4, max_new=3, seed=5, sampled=True, ignore_eos=True)
    _do(m, "step", n=1)
    _do(m, "reload", i=_index(m, 0))  # the decoding tenant's: refused, nothing changes
    _do(m, "step", n=4)


def _chunked_prefill_interleaved(m) -> None:
    # A 5-token budget: adapter 1's 19-token prompt is cut into chunks, each step mixed with the
    # decodes of adapter 0 and of a base request.
    _start(m, budget=5)
    _do(m, "add_request", adapter=0, length=2, max_new=5, seed=6, sampled=False, ignore_eos=True)
    _do(m, "add_request", adapter=-1, length=2, max_new=5, seed=7, sampled=False, ignore_eos=True)
    _do(m, "step", n=1)
    _do(m, "add_request", adapter=1, length=19, max_new=2, seed=8, sampled=False, ignore_eos=True)
    _do(m, "step", n=4)
    _do(m, "step", n=4)


def _idle_step_between_batches(m) -> None:
    # A batch over three adapters, idle steps, then a base-only batch and a one-adapter batch that
    # replay in the buckets the larger batch used.
    _start(m)
    _do(m, "add_burst", n=9, adapters=3, offset=1, seed=9)
    _do(m, "step", n=4)
    _do(m, "step", n=4)
    _do(m, "idle_step")
    _do(m, "idle_step")
    _do(m, "add_burst", n=2, adapters=0, offset=0, seed=10)
    _do(m, "step", n=4)
    _do(m, "idle_step")
    _do(m, "add_request", adapter=2, length=3, max_new=3, seed=11, sampled=False, ignore_eos=True)
    _do(m, "step", n=4)


def _adapters_and_base_overflow(m) -> None:
    # Four adapters and base requests arrive together with a per-batch cap of 2 on 3 slots: every
    # batch keeps the cap, later adapters wait their turn, evicting earlier ones.
    _start(m, per_batch=2)
    _do(m, "add_burst", n=9, adapters=4, offset=0, seed=12)
    _do(m, "add_request", adapter=3, length=7, max_new=4, seed=13, sampled=False, ignore_eos=True)
    _do(m, "step", n=4)
    _do(m, "step", n=4)


def _prefill_past_32_requests(m) -> None:
    # 40 one-token base prompts: one prefill step of 40 requests, which the prefill graph's 64
    # request slots hold (no 32 cap), then decode batches shrinking inside the largest bucket.
    _start(m)
    _do(m, "add_burst", n=40, adapters=0, offset=0, seed=14)
    _do(m, "step", n=4)


def _decode_batch_shrinks_in_a_bucket(m) -> None:
    # Two decodes in the 2-bucket, the first finishing first: the next decode replays the bucket with
    # one live row, the other request now in row 0.
    _start(m)
    _do(m, "add_request", adapter=0, length=3, max_new=2, seed=15, sampled=False, ignore_eos=True)
    _do(m, "add_request", adapter=1, length=4, max_new=5, seed=16, sampled=False, ignore_eos=True)
    _do(m, "step", n=4)
    _do(m, "step", n=4)


#: name → history, one per public fault class (plus the graph runners' two).
HISTORIES: dict[str, History] = {
    "evicted-slot-reused": History("an evicted slot reused with the old adapter's modules", "eager", 2,
                                   _evicted_slot_reused),
    "hot-load-during-decode": History("a hot load during decode serving another tenant's adapter", "full", 3,
                                      _hot_load_during_decode),
    "chunked-prefill-interleaved": History("chunked prefill interleaving breaking the token→adapter mapping",
                                           "full", 3, _chunked_prefill_interleaved),
    "idle-step-between-batches": History("an idle step reusing the previous batch's metadata", "full", 3,
                                         _idle_step_between_batches),
    "adapters-and-base-overflow": History("N adapters + base overflowing the batch", "full", 3,
                                          _adapters_and_base_overflow),
    "prefill-past-32-requests": History("a prefill graph capped at 32 request slots", "full", 3,
                                        _prefill_past_32_requests),
    "decode-batch-shrinks-in-a-bucket": History("a decode graph whose bucket tail is not reset", "decode_graph", 3,
                                                _decode_batch_shrinks_in_a_bucket),
}


def run_history(name: str, *, backend: str, model_dir: str | Path, adapters: Mapping[str, str | Path],
                device: str = "cpu", dtype: str = "float32", engine_class: type | None = None) -> None:
    """Run history ``name`` on a fresh machine (adapters in the order the module doc says).

    Raises:
        AssertionError: an invariant or a comparison failed (the message names it).
        ValueError: fewer than 5 adapters.
    """
    if len(adapters) < 5:
        raise ValueError(f"the named histories need 5 adapters (module doc), got {len(adapters)}")
    if engine_class is None:
        from moelora_runner import Engine as engine_class
    history = HISTORIES[name]
    paths = {n: Path(p) for n, p in adapters.items()}
    config = MachineConfig(backend, Path(model_dir), tuple(paths.items()), history.max_loras, pool_rank(paths),
                           device, dtype, history.mode, engine_class, (history.mode,))
    machine = machine_class(config)()
    try:
        history.run(machine)
    except BaseException:
        machine._tmp.cleanup()  # the failure stands as it is; the teardown's checks would only add noise
        raise
    machine.teardown()
