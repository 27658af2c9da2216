"""P13: adapters read from real PEFT files mean what their files say.

The case's adapters are adapter directories the suite writes itself (:mod:`moelora_conformance.peft_files`):
fused ``target_parameters`` adapters saved by peft and legacy per-expert ones, rsLoRA or not,
``rank_pattern`` / ``alpha_pattern``, factors stored in fp32, fp16 or bf16, one or two decoder
layers (one per MoE layer of the case), attention projections of a Qwen3-MoE geometry. They are
read by moelora's readers (``read_adapter`` → ``load_adapter_into_slot``) into the pool *after*
the backend's factory ran, in its process — a reader fault a backend's package puts in is caught
too — and the expected values come from the files independently (peft's own reading; a per-module
reference for the legacy format). The first example of every item loads a fused rsLoRA file of
rank 2 (the simplest draw, which Hypothesis tries first). The drawn batch runs in the mode and gets
the standard checks; then a used slot is reloaded with another file adapter lacking a module the
previous one had (graph modes: after the capture), and the batch runs again on the pool as it is now.

Without transformers and peft (the ``fixtures`` extra) the items are reported ``not_run``.
"""

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from moelora_conformance.harness import derive_inputs
from moelora_conformance.peft_files import file_adapters, geometries
from moelora_conformance.properties.registry import conformance
from moelora_conformance.properties.support import Subject, draw_capacity, draw_case, draw_moe_path, trace
from moelora_conformance.strategies.adapters import pool_ranks, pool_scalings
from moelora_conformance.strategies.batches import BatchPlan
from moelora_conformance.strategies.choice import uniform
from moelora_conformance.strategies.suite import mode_forward, pool_batches, tokens_per_request
from moelora_core.batch import BatchSpec
from moelora_core.forward_mode import ForwardMode


def _on_pool(like: BatchSpec, pool) -> BatchSpec:
    return BatchSpec(like.forward_mode, like.requests, like.max_loras, pool_ranks(pool), pool_scalings(pool))


@conformance("P13")
@given(data=st.data())
def test_adapters_read_from_peft_files_mean_what_the_files_say(moelora_suite, mode, dtype, data):
    suite = moelora_suite
    caps = suite.caps
    # per-expert pools: the files are peft's per-expert / fused adapters, which a pool storing expert
    # factors once per slot refuses (ExpertLayoutError); shared layouts are drawn by every other property
    drawn = draw_case(data, suite, mode, dtype, kinds=("extend", "decode", "mixed"), moe_layers=(1, 2),
                      shared_expert_factors=False)
    geometry = data.draw(geometries(caps.max_hidden), label="attention geometry")
    modules = tuple(m for m, _ in drawn.shape.dense_shapes)
    # R of at least 4 where the caps allow: the simplest file is then an rsLoRA adapter of rank 2,
    # whose σ = α/√2 a reader that drops the flag gets wrong
    shape = replace(drawn.shape, dense_shapes=geometry.dense_shapes(drawn.shape.hidden_size, modules),
                    max_rank=max(drawn.shape.max_rank, min(4, caps.max_rank)))
    layers = drawn.moe_layers  # one decoder layer per MoE layer: keys naming layer 1 count in two-layer cases
    files = [data.draw(file_adapters(shape, layers=layers), label="slot 0 file")]
    files += [data.draw(st.one_of(st.none(), file_adapters(shape, layers=layers)), label=f"slot {s} file")
              for s in range(1, shape.max_loras)]
    pool = tuple(None if f is None else f.slot_adapter() for f in files)
    for slot, f in enumerate(files):
        if f is not None:
            trace(f"slot {slot}: file {f.describe()}")
    fmode = mode_forward(mode, drawn.batch)
    tpr = tokens_per_request(drawn.batch)
    like = BatchSpec(ForwardMode.IDLE, (), shape.max_loras, pool_ranks(pool), pool_scalings(pool))
    n = data.draw(st.integers(1, max(1, min(caps.max_requests, caps.max_tokens // tpr, 12))), label="requests")
    batch = data.draw(pool_batches(like, fmode, n, max_tokens=caps.max_tokens, tokens_per_request=tpr,
                                   adapters=data.draw(uniform(("adapters", "mixed")), label="adapters")),
                      label="batch")
    empty = (None,) * shape.max_loras  # nothing drawn into the pool: the files fill it
    case = replace(drawn, shape=shape, pool=empty,
                   plan=BatchPlan(batch, drawn.plan.kind if fmode is drawn.batch.forward_mode else "extend",
                                  "files", "drawn"))
    path = draw_moe_path(data, suite)
    capacity = draw_capacity(data, mode, [batch])
    subject = Subject(suite, case, mode, path, capacity)  # the backend's factory runs here
    builder = suite.peft_files()
    config = builder.model_config(shape, geometry, case.moe_layers)
    for slot, f in enumerate(files):
        if f is not None:
            subject.layer.load_files(slot, builder.build(f, shape, geometry, case.moe_layers), config)
    inp = derive_inputs(case, subject.m, batch, seed=case.seed + 13)
    subject.run_and_check(inp, "the batch on adapters read from files")

    used = sorted({r.slot for r in batch.requests if r.slot >= 0 and files[r.slot] is not None})
    if not used:
        return
    slot = data.draw(uniform(used), label="slot reloaded from a file")
    had = [m for m, _, _ in files[slot].modules() if m in ("gate", "up", "down")]
    lacking = tuple(data.draw(st.lists(uniform(had), min_size=1, max_size=1), label="module it lacks")) if had else ()
    new = data.draw(file_adapters(shape, experts_lacking=lacking, layers=layers), label="reloaded file")
    trace(f"slot {slot}: reloaded with file {new.describe()} (lacks {list(lacking)})")
    subject.layer.load_files(slot, builder.build(new, shape, geometry, case.moe_layers), config)
    pool = tuple(new.slot_adapter() if s == slot else a for s, a in enumerate(pool))
    again = _on_pool(batch, pool)
    subject.run_and_check(derive_inputs(case, subject.m, again, seed=case.seed + 17),
                          "the batch after a slot was reloaded from a file")
