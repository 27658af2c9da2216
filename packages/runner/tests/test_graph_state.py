"""Nothing of an earlier batch leaks into a later replay of the same bucket (DESIGN.md §3: static
buffers written in place, tails reset), on the CPU emulator (real CUDA graphs with
``MOELORA_RUNNER_DEVICE=cuda``).

- ``test_small_batches_after_a_larger_adapter_batch_equal_a_fresh_engine``: one prefill bucket and one
  decode bucket serve every step of an engine: a larger batch on three adapters, an idle step, a
  base-only batch of two requests, then a one-request batch on an adapter. The two small batches give
  bitwise the outputs (CPU; within ``graph_vs_eager`` on CUDA) of the same batches on fresh engines
  of the same configuration, and the engine captured each bucket once.
- ``test_static_batch_tails_are_reset``: a :class:`StaticForwardBatch` (one per graph family) written
  with a larger step then a smaller step in a smaller bucket holds, in that bucket's views, the smaller
  step's values and the pad values (token 0, position 0, the null KV location, the padding row)
  everywhere else, at unchanged addresses; the live batch it returns is the views of the step's rows.
"""

from __future__ import annotations

import graph_support as gs
import pytest
import runner_support as rs
import torch

from moelora_conformance.profiles import current_profile
from moelora_core.batch import BatchSpec, Request
from moelora_core.errors import InvalidFieldError
from moelora_core.forward_mode import ForwardMode
from moelora_runner.forward_batch import ForwardBatchHost, StaticForwardBatch

MODEL = "qwen3_moe"
BACKENDS = [pytest.param("reference", marks=pytest.mark.xdist_group("graphs-reference")),
            pytest.param("triton", marks=[pytest.mark.interpreter, pytest.mark.xdist_group("graphs-triton")]),
            pytest.param("csgmv", marks=[pytest.mark.interpreter, pytest.mark.xdist_group("graphs-csgmv")])]
#: Every step in one prefill bucket (32 tokens) and one decode bucket (8 requests); a KV cache so small
#: that the later requests get KV locations the larger batch used (its K/V is still there: nothing may
#: read it as theirs).
CONFIG = dict(max_loras=3, max_num_batched_tokens=32, kv_cache_tokens=40, prefill_token_buckets=(32,),
              decode_batch_buckets=(8,))
#: CI-sized: one mode per kernel backend on the CPU in the interpret profile.
CI_CROSS = {("triton", "breakable"), ("csgmv", "full")}

pytestmark = pytest.mark.cudagraph


@pytest.mark.parametrize("mode", ["full", "breakable"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_small_batches_after_a_larger_adapter_batch_equal_a_fresh_engine(backend, mode, make_engine,
                                                                          engine_adapters):
    if (backend, mode) in CI_CROSS and rs.DEVICE == "cpu" and current_profile().name == "interpret":
        pytest.skip("CI-sized: this backend runs the case in its other mode here")
    names = [n for n, _ in engine_adapters[MODEL]]
    large = rs.mixed_requests(names[:3], 6, seed=5, prompt_len=(3, 5), max_new_tokens=2, ignore_eos=True)
    base_only = rs.mixed_requests([None], 2, seed=6, prompt_len=(1, 3), max_new_tokens=2, ignore_eos=True)
    one_adapter = rs.mixed_requests([names[2]], 1, seed=7, prompt_len=(2, 2), max_new_tokens=2, ignore_eos=True)

    def engine():
        return make_engine(MODEL, backend=backend, dtype=gs.DTYPE, **CONFIG, **gs.MODES[mode])

    used = engine()
    written: list[set[int]] = []
    inner = used.runner.forward
    used.runner.forward = lambda plan: (written.append(set(plan.host.out_cache_loc)), inner(plan))[1]
    used.generate(large)
    large_locs = set().union(*written)
    assert used.step() == [] and gs.passes(used)[("idle", "eager", "disabled")] == 1  # an idle step between
    written.clear()
    got_base = used.generate(base_only)
    assert large_locs & set().union(*written), "the base-only batch reuses KV locations of the larger one"
    got_one = used.generate(one_adapter)
    gs.assert_ran_on_graphs(used, mode)
    runner = used.runner
    assert (runner.prefill_graph.captures, runner.decode_graph.captures) == (1, 1), "one bucket per family, reused"
    gs.assert_same_outputs(got_base, engine().generate(base_only), what=f"{backend} {mode} base-only after larger")
    gs.assert_same_outputs(got_one, engine().generate(one_adapter), what=f"{backend} {mode} one adapter after base")


def _host(n_tokens: int, n_requests: int, base: int) -> ForwardBatchHost:
    per = n_tokens // n_requests
    spec = BatchSpec(ForwardMode.EXTEND, [Request(0, per, 0)] * n_requests, 1, (4,), (1.0,))
    ids = tuple(range(base, base + n_tokens))
    return ForwardBatchHost(spec, ids, tuple(range(1, n_tokens + 1)), tuple(range(base + 1, base + 1 + n_tokens)),
                            tuple([3] * n_tokens), tuple(range(n_requests)), tuple([per] * n_requests), ())


def test_static_batch_tails_are_reset():
    static = StaticForwardBatch(max_tokens=12, max_requests=4, max_context=16, null_location=0, padding_row=9,
                                device=torch.device(rs.DEVICE))
    addresses = {n: b.tensor.data_ptr() for n, b in static.buffers.items()}
    static.write(_host(12, 4, base=50))
    small = _host(4, 2, base=7)
    live = static.write(small, tokens=8, requests=3)  # the bucket of 8 tokens / 3 requests
    pads = {"input_ids": 0, "positions": 0, "out_cache_loc": 0, "token_rows": 9, "req_pool_indices": 9, "seq_lens": 0}
    for name, pad in pads.items():
        buffer, rows = static.buffers[name], 3 if name in ("req_pool_indices", "seq_lens") else 8
        want = list(getattr(small, name))
        assert buffer.tensor.tolist()[:rows] == want + [pad] * (rows - len(want)), name
        assert buffer.tensor.data_ptr() == addresses[name], f"{name} moved"
        assert getattr(live, name).tolist() == want and getattr(live, name).data_ptr() == addresses[name], name
    assert live.num_tokens == 4 and live.max_context == small.max_context
    fb = static.forward_batch(lora_info=None, tokens=8, requests=3)
    assert fb.num_tokens == 8 and fb.seq_lens.numel() == 3 and fb.max_context == 16 and fb.logits_indices.numel() == 0
    with pytest.raises(InvalidFieldError, match="exceed capacity"):
        static.write(_host(16, 4, base=0))
    with pytest.raises(InvalidFieldError, match="exceed capacity"):
        static.write(_host(12, 4, base=0), tokens=8, requests=4)
    assert static.buffers["input_ids"].tensor.tolist()[:4] == list(small.input_ids), "a refused write changes nothing"
