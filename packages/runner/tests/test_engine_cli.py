"""The ``moelora`` command: ``generate`` on the fixture files, its outputs, exit status, stderr and
metrics; ``make-fixtures``.

Covers: a JSONL run with text and token-id prompts, adapters and base requests writes one line per
request in input order with vLLM-shaped logprobs and the same tokens as the Python API, the sizing
line and summary table on stderr, the metrics file (exit 0); a failing request is written with its
error and makes the exit status 1; an adapter the reader refuses at start-up, a malformed request
file (a ``request_id`` given twice included), bad arguments exit 2 with the reason on stderr and write no
output; Ctrl-C writes the finished requests (rewriting an earlier run's file), one line on stderr, exit 130,
and the same holds for a Ctrl-C while the command is still importing torch (an earlier run's file emptied);
a ``max_new_tokens`` the context caps is said in the output line and on stderr; the metrics HTTP endpoint
serves the registry; ``make-fixtures`` reports what it built.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from moelora_runner import Engine
from moelora_runner.cli import main
from moelora_runner.metrics import EngineMetrics

MODEL = "qwen3_moe"


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def files(tmp_path, fixture_set):
    adapters = {"r8": fixture_set.adapter_dir(f"{MODEL}-r8"), "legacy": fixture_set.adapter_dir(f"{MODEL}-legacy")}
    requests = [
        {"request_id": "text", "prompt": "Hello, MoE!", "max_new_tokens": 4},
        {"request_id": "ids", "prompt_token_ids": [5, 17, 42, 8], "adapter": "r8", "prompt_logprobs": True,
         "max_new_tokens": 3, "logprobs": 2},
        {"prompt": "no id here", "adapter": "legacy", "max_new_tokens": 2, "temperature": 0.7, "seed": 3},
        {"request_id": "zero", "prompt_token_ids": [9, 9], "max_new_tokens": 0, "prompt_logprobs": True},
    ]
    argv = ["generate", "--model", str(fixture_set.model_dir(MODEL)), "--max-lora-rank", "16", "--no-progress",
            *[arg for n, p in adapters.items() for arg in ("--adapter", f"{n}={p}")],
            "--requests", str(_write(tmp_path / "requests.jsonl", requests)), "--output", str(tmp_path / "out.jsonl")]
    return argv, requests, adapters, tmp_path


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generate_writes_every_request_in_input_order(files, fixture_set, capsys):
    argv, requests, adapters, tmp = files
    assert main([*argv, "--metrics-file", str(tmp / "m.prom")]) == 0
    out = _lines(tmp / "out.jsonl")
    assert [o["request_id"] for o in out[:2]] == ["text", "ids"] and out[3]["request_id"] == "zero"
    assert all(o["finish_reason"] == "length" for o in out)
    assert out[1]["prompt_logprobs"][0] is None and len(out[1]["prompt_logprobs"]) == 4
    assert len(out[1]["top_logprobs"]) == 3 and len(out[1]["top_logprobs"][0]) == 2
    assert out[0]["prompt_logprobs"] is None and out[0]["prompt_token_ids"][0] == 0  # tokenized, with BOS
    assert out[3]["output_token_ids"] == [] and len(out[3]["prompt_logprobs"]) == 2
    engine = Engine(fixture_set.model_dir(MODEL), max_lora_rank=16)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    api = engine.generate(requests)
    assert [o["output_token_ids"] for o in out] == [o.output_token_ids for o in api]
    err = capsys.readouterr().err
    assert "moelora: model" in err and "KV cache 8192 tokens" in err and "adapter slot" in err
    assert "moelora generate" in err and "tokens/s" in err and "r8" in err and "(base)" in err
    metrics = (tmp / "m.prom").read_text()
    assert 'moelora_forward_passes_total{mode="eager",phase="prefill",reason="disabled"}' in metrics
    assert "moelora_tokens_total" in metrics and "moelora_step_latency_seconds_bucket" in metrics


def test_generate_serves_shared_outer_adapters_stored_once(files, fixture_set, capsys):
    """``--expert-layout shared_outer``: the layout fixtures served as the Python API serves them with
    ``expert_layout="shared_outer"``, the sizing line naming the layout; a per-expert adapter is refused
    at start-up (exit 2) by such a pool."""
    tmp = files[3]
    layout = {n: fixture_set.layout_adapter_dir(n) for n, e in sorted(fixture_set.layout_adapters().items())
              if e["model"] == MODEL}
    names = sorted(layout)
    rows = [{"request_id": f"q{i}", "prompt_token_ids": [3 + i, 11, 7], "max_new_tokens": 3,
             **({"adapter": names[i % len(names)]} if i % 3 else {})} for i in range(6)]
    argv = ["generate", "--model", str(fixture_set.model_dir(MODEL)), "--max-lora-rank", "16", "--no-progress",
            "--expert-layout", "shared_outer", *[a for n, d in layout.items() for a in ("--adapter", f"{n}={d}")],
            "--requests", str(_write(tmp / "layout.jsonl", rows)), "--output", str(tmp / "layout-out.jsonl")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "expert factors shared_outer" in err
    engine = Engine(fixture_set.model_dir(MODEL), max_lora_rank=16, expert_layout="shared_outer")
    for name, path in layout.items():
        engine.load_adapter(name, path)
    api = engine.generate(rows)
    assert [o["output_token_ids"] for o in _lines(tmp / "layout-out.jsonl")] == [o.output_token_ids for o in api]
    per_expert = ["--adapter", f"r8={fixture_set.adapter_dir(f'{MODEL}-r8')}"]
    assert main([*argv, *per_expert]) == 2
    assert "adapter 'r8' refused: ExpertLayoutError" in capsys.readouterr().err


def test_a_failed_request_is_written_and_exits_1(files, capsys):
    argv, requests, _, tmp = files
    _write(tmp / "requests.jsonl", [*requests[:2], {"request_id": "bad", "prompt_token_ids": [3], "adapter": "nope"},
                                    {"request_id": "n2", "prompt_token_ids": [3], "n": 2}])
    assert main(argv) == 1
    out = _lines(tmp / "out.jsonl")
    assert [o["finish_reason"] for o in out] == ["length", "length", "error", "error"]
    assert out[2]["error"]["type"] == "UnknownAdapterError" and out[3]["error"]["type"] == "InvalidRequestError"
    assert "only n = 1" in out[3]["error"]["message"]
    assert "request 'bad' failed: UnknownAdapterError" in capsys.readouterr().err


def test_an_adapter_refused_at_start_up_exits_2_before_any_request(files, fixture_set, capsys):
    argv, _, _, tmp = files
    bad = fixture_set.bad_adapter("bad-dora")
    assert main([*argv, "--adapter", f"dora={fixture_set.bad_adapter_dir('bad-dora')}"]) == 2
    err = capsys.readouterr().err
    assert f"adapter 'dora' refused: {bad['refusal']}" in err and "use_dora" in err
    assert "moelora generate" not in err and not (tmp / "out.jsonl").exists()


@pytest.mark.parametrize("case", ["bad-json", "not-object", "missing-file", "bad-adapter-arg", "bad-flag",
                                  "bad-model", "rank-zero", "duplicate-id"])
def test_usage_errors_exit_2(files, case, capsys):
    argv, _, _, tmp = files
    if case == "bad-json":
        _write(tmp / "requests.jsonl", ['{"prompt_token_ids": [1]}', "{oops"])
        want = "line 2: not valid JSON"
    elif case == "not-object":
        _write(tmp / "requests.jsonl", ["[1, 2]"])
        want = "must be a JSON object"
    elif case == "missing-file":
        (tmp / "requests.jsonl").unlink()
        want = "cannot read --requests"
    elif case == "bad-adapter-arg":
        argv = [*argv, "--adapter", "no-equals-sign"]
        want = "expected NAME=DIR"
    elif case == "bad-flag":
        argv = [*argv, "--moe-impl", "cuda-magic"]
        want = "invalid choice"
    elif case == "bad-model":
        argv = [*argv, "--model", str(tmp)]
        want = "cannot start: CheckpointFormatError"
    elif case == "duplicate-id":  # never two result lines for one id
        _write(tmp / "requests.jsonl", [{"request_id": "a", "prompt_token_ids": [1]}, {"prompt_token_ids": [2]},
                                        {"request_id": "a", "prompt_token_ids": [3]}])
        want = "line 3: request_id 'a' is already used on line 1"
    else:
        argv = [*argv, "--max-lora-rank", "0"]
        want = "max_lora_rank: must be an int >= 1"
    assert main(argv) == 2
    assert want in capsys.readouterr().err
    assert not (tmp / "out.jsonl").exists()


def test_ctrl_c_writes_the_finished_requests_and_exits_130(files, monkeypatch, capsys):
    argv, requests, _, tmp = files
    (tmp / "out.jsonl").write_text('{"request_id": "from an earlier run"}\n')
    steps = {"n": 0}
    real_step = Engine.step

    def step_then_interrupt(self):
        steps["n"] += 1
        if steps["n"] == 4:  # as SIGINT raises KeyboardInterrupt wherever the main thread is
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Engine, "step", step_then_interrupt)
    assert main(argv) == 130
    out = _lines(tmp / "out.jsonl")
    assert 0 < len(out) < len(requests) and all(o["finish_reason"] == "length" for o in out)
    position = {"text": 0, "ids": 1, "zero": 3}  # the third request has no id: the engine names it req-<n>
    order = [position.get(o["request_id"], 2) for o in out]
    assert order == sorted(order) and len(set(order)) == len(order)  # input order, each once, no earlier run
    err = capsys.readouterr().err
    assert f"of {len(requests)} requests finished" in err and "Traceback" not in err
    assert "moelora generate" not in err  # no summary table of a run that did not finish


def test_ctrl_c_before_serving_leaves_no_stale_results(files, monkeypatch, capsys):
    argv, _, _, tmp = files
    (tmp / "out.jsonl").write_text('{"request_id": "from an earlier run"}\n')

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Engine, "load_adapter", interrupted)
    assert main(argv) == 130
    assert (tmp / "out.jsonl").read_text() == ""
    assert "before any request ran" in capsys.readouterr().err


# The console script as pip writes it, with the import of torch held open until the test sends SIGINT:
# the interrupt lands inside `import torch`, as a Ctrl-C in the command's first seconds does.
_SLOW_TORCH = """
import sys, time

class SlowTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("importing torch", flush=True)
            time.sleep(60)
        return None

sys.meta_path.insert(0, SlowTorch())
from moelora_runner.cli import main
sys.exit(main())
"""


def test_ctrl_c_while_importing_torch_is_one_line_and_130(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"request_id": "from an earlier run"}\n')
    argv = ["generate", "--model", str(tmp_path), "--requests", str(tmp_path / "r.jsonl"), "--output", str(out)]
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_TORCH, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        # the console script's own module imports no torch: the first import of torch is inside main's guard
        assert proc.stdout.readline() == "importing torch\n"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.splitlines() == [f"moelora: interrupted (Ctrl-C) before any request ran; {out} is empty"]
    assert out.read_text() == ""


def test_a_capped_max_new_tokens_is_said(files, capsys):
    argv, _, _, tmp = files
    _write(tmp / "requests.jsonl", [{"request_id": "long", "prompt_token_ids": [5, 6, 7], "max_new_tokens": 10_000}])
    assert main(argv) == 0
    (out,) = _lines(tmp / "out.jsonl")
    assert out["warnings"] == [w for w in out["warnings"] if w.startswith("max_new_tokens 10000 capped to ")]
    assert len(out["warnings"]) == 1 and len(out["output_token_ids"]) < 10_000
    assert "request 'long': max_new_tokens 10000 capped to" in capsys.readouterr().err


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_endpoint_serves_the_registry():
    metrics = EngineMetrics()
    metrics.forward_pass("decode", "eager", "disabled")
    server, thread = metrics.serve(0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert 'moelora_forward_passes_total{mode="eager",phase="decode",reason="disabled"} 1.0' in body


def test_generate_with_a_metrics_port(files, capsys):
    argv, _, _, _ = files
    port = _free_port()
    assert main([*argv, "--metrics-port", str(port)]) == 0
    assert f"http://127.0.0.1:{port}/metrics" in capsys.readouterr().err


def test_make_fixtures_reports_what_it_built(tmp_path, fixture_set, monkeypatch, capsys):
    import moelora_conformance.fixtures as fixtures

    monkeypatch.setattr(fixtures, "build_fixtures", lambda directory: fixture_set)
    assert main(["make-fixtures", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "built 12 models, 24 adapters, 16 bad adapters" in out and "models/qwen3_moe: adapters qwen3_moe-bf16" in out
