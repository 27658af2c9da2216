"""Eager fallback, counted, and the graph settings (DESIGN.md §6; ``moelora_runner.graph_config``).

- ``test_beyond_capacity_runs_eagerly_with_a_reason``: steps with more tokens than the largest prefill
  bucket (``over_tokens``), more requests than the prefill graph's request slots or the largest decode
  bucket (``over_requests``), a backend answering ``Fallback`` (``backend_fallback``, its text kept in
  ``runner.last_fallback``) and a phase without a graph (``disabled``) run eagerly, each counted
  ``moelora_forward_passes_total{phase, mode="eager", reason}``, the others on the graph with
  ``reason=""``; outputs equal an eager engine's.
- ``test_default_buckets_and_resolution``: the default buckets (decode 1, 2, 4, 8, 16, 24, 32, then
  steps of 16 up to ``max_bs``; prefill doubling from 16 up to the token budget); CPU defaults eager,
  CUDA defaults ``full`` + decode graph captured at start-up; a CPU engine without graph arguments
  builds no graph runner.
- ``test_bad_graph_arguments_are_refused``: an unknown mode, a mode or family the backend does not
  declare, malformed buckets, ``max_num_requests`` < 1, an unknown capture policy: ``EngineConfigError``
  naming the argument.
- ``test_cli_graph_flags``: ``moelora generate --graph breakable --decode-graph`` with bucket lists
  runs on the graphs (metrics file, the passes table and the graph settings on stderr); a malformed
  bucket list exits 2.
"""

from __future__ import annotations

import json

import graph_support as gs
import pytest
import torch

from moelora_core.capabilities import Capabilities
from moelora_runner import Engine, EngineConfigError
from moelora_runner.cli import main
from moelora_runner.graph_config import (
    GraphConfig,
    default_decode_buckets,
    default_prefill_buckets,
    parse_buckets,
    resolve_graph_config,
)

MODEL = "qwen3_moe"

pytestmark = [pytest.mark.cudagraph, pytest.mark.xdist_group("graphs-reference")]


def _requests(n: int, prompt: int, *, new: int = 2) -> list[dict]:
    return [dict(request_id=f"r{i}", prompt_token_ids=[3 + i + j for j in range(prompt)], max_new_tokens=new,
                 ignore_eos=True, logprobs=2, prompt_logprobs=True) for i in range(n)]


@pytest.mark.parametrize("case", ["over_tokens", "over_requests_prefill", "over_requests_decode",
                                  "backend_fallback", "disabled"])
def test_beyond_capacity_runs_eagerly_with_a_reason(case, make_engine):
    base = dict(max_num_batched_tokens=12, kv_cache_tokens=128, dtype=gs.DTYPE)
    requests, config, expected = {
        # 3 x 5 tokens under a 12-token budget: the 12-token first step is past the 8-token bucket, the
        # second (the last 3 prompt tokens and 2 decodes) fits it.
        "over_tokens": (_requests(3, 5), dict(gs.MODES["full"], prefill_token_buckets=(8,)),
                        {("prefill", "eager", "over_tokens"): 1, ("prefill", "full", ""): 1,
                         ("decode", "decode_graph", ""): 1}),
        "over_requests_prefill": (_requests(3, 2), dict(gs.MODES["breakable"], max_num_requests=2),
                                  {("prefill", "eager", "over_requests"): 1, ("decode", "decode_graph", ""): 1}),
        "over_requests_decode": (_requests(3, 2), dict(gs.MODES["full"], decode_batch_buckets=(1, 2)),
                                 {("prefill", "full", ""): 1, ("decode", "eager", "over_requests"): 1}),
        "backend_fallback": (_requests(3, 2), dict(gs.MODES["full"], backend="graph_support:make_two_request_backend"),
                             {("prefill", "eager", "backend_fallback"): 1, ("decode", "eager", "backend_fallback"): 1}),
        "disabled": (_requests(2, 2), gs.MODES["decode_graph"],
                     {("prefill", "eager", "disabled"): 1, ("decode", "decode_graph", ""): 1}),
    }[case]
    engine = make_engine(MODEL, adapters=False, **base, **config)
    got = engine.generate(requests)
    assert gs.passes(engine) == expected
    if case == "backend_fallback":
        assert engine.runner.last_fallback == ("decode", "backend_fallback", "3 requests > 2 (test backend)")
    want = make_engine(MODEL, adapters=False, **base, **gs.MODES["eager"]).generate(requests)
    gs.compare_outputs(got, want, what=f"{case} vs eager")


def test_default_buckets_and_resolution(fixture_set):
    assert default_decode_buckets(256) == (1, 2, 4, 8, 16, 24, 32, *range(48, 257, 16))
    assert default_decode_buckets(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert default_decode_buckets(20) == (1, 2, 4, 8, 16, 20) and default_decode_buckets(1) == (1,)
    assert default_prefill_buckets(2048) == (16, 32, 64, 128, 256, 512, 1024, 2048)
    assert default_prefill_buckets(100) == (16, 32, 64, 100) and default_prefill_buckets(8) == (8,)
    assert parse_buckets("x", "32, 16,16") == (16, 32) and parse_buckets("x", [4, 1]) == (1, 4)
    caps = Capabilities(dtypes=frozenset({torch.float32}), graph_families=frozenset({"decode", "prefill"}),
                        prefill_graph_modes=frozenset({"full", "breakable"}))
    common = dict(caps=caps, backend="b", graph=None, decode_graph=None, max_num_requests=None,
                  prefill_token_buckets=None, decode_batch_buckets=None, max_num_batched_tokens=2048, max_bs=256,
                  capture=None)
    assert resolve_graph_config(device=torch.device("cpu"), **common) == GraphConfig(capture="lazy")
    cuda = resolve_graph_config(device=torch.device("cuda"), **common)
    assert (cuda.prefill, cuda.decode_graph, cuda.capture, cuda.max_num_requests) == ("full", True, "startup", 64)
    assert cuda.prefill_buckets == default_prefill_buckets(2048) and cuda.decode_buckets == default_decode_buckets(256)
    assert cuda.prefill_requests(16) == 16 and cuda.prefill_requests(2048) == 64
    bare = resolve_graph_config(device=torch.device("cuda"), **{**common, "caps": Capabilities(dtypes=caps.dtypes)})
    assert not bare.any_graph, "a backend without graph families runs eagerly by default"
    engine = Engine(fixture_set.model_dir(MODEL), max_lora_rank=16)
    assert not engine.graphs.any_graph and engine.runner.prefill_graph is None and engine.runner.decode_graph is None


@pytest.mark.parametrize(("kwargs", "field", "message"), [
    (dict(graph="cuda"), "graph", "must be one of"),
    (dict(graph="full", backend="graph_support:make_no_graph_backend"), "graph", "does not declare"),
    (dict(decode_graph=True, backend="graph_support:make_no_graph_backend"), "decode_graph", "does not declare"),
    (dict(graph="full", prefill_token_buckets="16,x"), "prefill_token_buckets", "comma list of ints"),
    (dict(decode_graph=True, decode_batch_buckets=[0, 4]), "decode_batch_buckets", "ints >= 1"),
    (dict(graph="full", prefill_token_buckets=""), "prefill_token_buckets", "at least one bucket"),
    (dict(graph="full", max_num_requests=0), "max_num_requests", ">= 1"),
    (dict(graph="full", graph_capture="later"), "graph_capture", "must be one of"),
])
def test_bad_graph_arguments_are_refused(kwargs, field, message, fixture_set):
    with pytest.raises(EngineConfigError, match=message) as info:
        Engine(fixture_set.model_dir(MODEL), max_lora_rank=16, **kwargs)
    assert str(info.value).startswith(field)


def test_cli_graph_flags(fixture_set, tmp_path, capsys):
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(r) + "\n" for r in _requests(3, 4)))
    argv = ["generate", "--model", str(fixture_set.model_dir(MODEL)), "--max-lora-rank", "16", "--no-progress",
            "--requests", str(requests), "--output", str(tmp_path / "out.jsonl"), "--max-num-batched-tokens", "16",
            "--metrics-file", str(tmp_path / "m.prom")]
    flags = ["--graph", "breakable", "--decode-graph", "--prefill-token-buckets", "16", "--decode-batch-buckets",
             "2,4", "--max-num-requests", "8"]
    assert main([*argv, *flags]) == 0
    metrics = (tmp_path / "m.prom").read_text()
    assert 'moelora_forward_passes_total{mode="breakable",phase="prefill",reason=""} 1.0' in metrics
    assert 'moelora_forward_passes_total{mode="decode_graph",phase="decode",reason=""} 1.0' in metrics
    err = capsys.readouterr().err
    assert "graphs: prefill breakable (tokens 16; 8 request slots), decode graph (bs 2,4), capture lazy" in err
    assert "forward passes" in err and "decode_graph" in err
    assert main([*argv, "--no-decode-graph", "--graph", "eager"]) == 0
    assert "graphs: prefill eager, decode eager" in capsys.readouterr().err
    assert main([*argv, "--graph", "full", "--prefill-token-buckets", "16,x"]) == 2
    assert "prefill_token_buckets" in capsys.readouterr().err
