"""Each refusal kind of the readers on a bad adapter built from what peft writes: the exact error class,
a message naming the adapter, the key or module and expected vs found, and no slot changed.

The pools (of the model the bad adapter is loaded for) hold two good adapters (slots 0 and 1) before
each attempt; after the refusal every tensor and host list of every layer's pool is bit-identical.
The Qwen2-MoE ones are shared-expert LoRA with wrong shapes (a lost row, a transposed A) and LoRA on
the shared expert's sigmoid gate. The rank case reads fine without a
limit and is refused when loaded into a pool of R = 16.
"""

import pytest
import torch

from moelora_conformance.fixtures import BAD_ADAPTERS
from moelora_conformance.fixtures.specs import POOL_MAX_RANK


def _snapshot(pools):
    out = []
    for p in pools:
        out.append(([t.clone() for t in (p.gate_up_A, p.gate_up_B, p.down_A, p.down_B, p.module_ranks,
                                          p.module_scalings, *p.dense_A.values(), *p.dense_B.values())],
                    repr((p.host_ranks, p.host_scalings, p.host_adapter_scalings))))
    return out


#: The two good adapters loaded into slots 0 and 1 of the model a bad adapter is loaded for.
GOOD = {"qwen3_moe": ("qwen3_moe-r8", "qwen3_moe-pattern"), "qwen2_moe": ("qwen2_moe-r8", "qwen2_moe-shared-only")}


def _loaded_pools(fixture_set, model):
    from moelora_core import LoRAWeights
    from moelora_core.checkpoint import load_adapter_into_slot, read_adapter, read_model_config

    cfg = read_model_config(fixture_set.model_dir(model))
    pools = [LoRAWeights(cfg.layer_spec(max_loras=2, max_rank=POOL_MAX_RANK)) for _ in range(cfg.num_layers)]
    for slot, name in enumerate(GOOD[model]):
        load_adapter_into_slot(pools, slot, read_adapter(fixture_set.adapter_dir(name), cfg, max_rank=POOL_MAX_RANK))
    return cfg, pools


@pytest.mark.parametrize("spec", BAD_ADAPTERS, ids=lambda s: s.name)
def test_bad_adapter_is_refused_and_no_slot_changes(fixture_set, spec):
    from moelora_core import AdapterError
    from moelora_core import checkpoint as ck

    cfg, pools = _loaded_pools(fixture_set, spec.model)
    before = _snapshot(pools)
    kind = getattr(ck, spec.refusal)
    path = fixture_set.bad_adapter_dir(spec.name)

    def attempt():
        if spec.refusal == "RankTooLargeError":
            adapter = ck.read_adapter(path, cfg)  # readable: only a pool of R = 16 refuses it
            assert adapter.max_rank() == 32
            ck.load_adapter_into_slot(pools, 1, adapter)
        else:
            ck.load_adapter_into_slot(pools, 1, ck.read_adapter(path, cfg, max_rank=POOL_MAX_RANK))

    with pytest.raises(AdapterError) as exc:
        attempt()
    err = exc.value
    assert type(err) is kind, f"{spec.name}: expected {spec.refusal}, got {type(err).__name__}: {err}"
    msg = str(err)
    assert msg.startswith(f"adapter '{spec.name}': "), msg
    for fragment in spec.message:
        assert fragment in msg, (fragment, msg)
    after = _snapshot(pools)
    for (tensors_before, host_before), (tensors_after, host_after) in zip(before, after):
        assert host_before == host_after
        assert all(torch.equal(a, b) for a, b in zip(tensors_before, tensors_after))
    if spec.refusal == "RankTooLargeError":  # the reader's own limit refuses it too
        with pytest.raises(ck.RankTooLargeError, match=r"expected <= 16, found 32"):
            ck.read_adapter(path, cfg, max_rank=POOL_MAX_RANK)


def test_every_refusal_kind_has_a_bad_adapter():
    from moelora_core.checkpoint import ADAPTER_REFUSALS

    covered = {s.refusal for s in BAD_ADAPTERS}
    kinds = {k.__name__ for k in ADAPTER_REFUSALS} - {"AdapterFormatError"}  # format errors: core tests
    assert kinds <= covered, kinds - covered
