"""No host sync inside a forward: the engine's eager forwards run under ``host_sync_guard`` in every
test (``check_host_sync=True`` is the test engines' default); these cases prove the guard is live
there and that the reference and kernel backends' prepare + forward pass it.

Covers: a ``.item()`` slipped into the model's forward fails the step with ``HostSyncError`` (and the
engine is not left half-stepped: the same engine serves the request correctly afterwards); a
prefill + decode run passes the guard on reference and, under the interpreter, on triton / csgmv
(the parity tests run the larger workloads with the guard on).
"""

from __future__ import annotations

import pytest
import runner_support as rs

from moelora_core import HostSyncError

MODEL = "olmoe"


def test_a_host_read_in_the_forward_fails_the_step(make_engine, monkeypatch):
    engine = make_engine(MODEL, adapters=False)
    clean = engine.generate([dict(request_id="a", prompt_token_ids=[4, 5, 6], max_new_tokens=2)])[0]
    logits = engine.model.logits

    def leaky(h, fb):
        fb.seq_lens.max().item()  # a host read of device data
        return logits(h, fb)

    monkeypatch.setattr(engine.model, "logits", leaky)
    engine.add_request(dict(request_id="b", prompt_token_ids=[4, 5, 6], max_new_tokens=2))
    with pytest.raises(HostSyncError, match="item" if rs.DEVICE == "cpu" else "synchroniz"):
        engine.step()
    monkeypatch.setattr(engine.model, "logits", logits)
    done = []
    while engine.has_unfinished():  # the failed step computed nothing: the same engine goes on
        done += engine.step()
    assert [o.output_token_ids for o in done] == [clean.output_token_ids]
    unguarded = make_engine(MODEL, adapters=False, check_host_sync=False)
    unguarded.model.logits = leaky
    assert unguarded.generate([dict(request_id="c", prompt_token_ids=[4, 5, 6], max_new_tokens=2)])[0] \
        .output_token_ids == clean.output_token_ids


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.interpreter),
                                     pytest.param("csgmv", marks=pytest.mark.interpreter)])
def test_prefill_and_decode_pass_the_guard(backend, make_engine, engine_adapters):
    engine = make_engine(MODEL, backend=backend, max_loras=2, max_num_batched_tokens=6)
    names = [n for n, _ in engine_adapters[MODEL]][:2]
    requests = [dict(request_id=f"r{i}", prompt_token_ids=[3 + i, 9, 27], adapter=[None, *names][i % 3],
                     max_new_tokens=2, ignore_eos=True) for i in range(3)]
    outputs = engine.generate(requests)
    assert [len(o.output_token_ids) for o in outputs] == [2, 2, 2]
    assert engine.runner.check_host_sync
