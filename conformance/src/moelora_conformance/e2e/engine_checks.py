"""Checks on an engine's outputs and metrics, shared by the e2e suite and the runner's tests
(``packages/runner/tests/runner_support.py`` and ``graph_support.py`` re-export them):

- :func:`passes`: ``moelora_forward_passes_total{phase, mode, reason}`` of an engine, as a dict;
- :func:`compare_outputs`: one run's outputs against another's (graph vs eager) within the
  ``graph_vs_eager`` row of ``moelora_core.tolerance``, greedy tokens up to the first near-tie;
- :class:`HFReference` / :func:`check_against_hf`: transformers + PEFT on the same sequences, one
  model per adapter (peft cannot mix expert adapters in one batch), within ``engine_vs_hf``; against a
  w8a8 model, a request whose departure flipped e4m3 crossings explain is set aside and named
  (``hf_check.fp8_crossings.find_crossing``).

Outputs are ``moelora_runner.RequestOutput`` (request_id, prompt_logprobs, output_token_ids,
output_logprobs, top_logprobs, finish_reason); nothing here imports the engine.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moelora_core import LogprobCheck, logprob_tolerance
from moelora_core.tolerance import MEAN_MIN_SAMPLES


def passes(engine) -> dict[tuple[str, str, str], int]:
    """(phase, mode, reason) → forward passes counted by ``engine``'s metrics (labels that never
    counted are left out)."""
    out = {}
    for metric in engine.metrics_.forward_passes.collect():
        for s in metric.samples:
            if s.name.endswith("_total") and s.value:
                out[(s.labels["phase"], s.labels["mode"], s.labels["reason"])] = int(s.value)
    return out


def compare_outputs(got, want, *, what: str, dtype: str = "float32", record_path: str | Path | None = None,
                    record: dict | None = None, device: str = "cpu",
                    comparison: str = "graph_vs_eager", base_quant: str = "none") -> tuple[float, float]:
    """``got`` (graph) against ``want`` (eager), request by request: prompt and output logprobs within
    the ``comparison`` row (``graph_vs_eager``; the TP tests compare against TP = 1 in ``tp_vs_tp1``),
    greedy tokens equal up to the first near-tie of the reference run's top-2
    margin (requests with ``logprobs >= 2``; the others must agree everywhere).

    Args:
        got, want: outputs of the same requests in the same order.
        what: named in every failure message. dtype: the engines' compute dtype (the row's key).
        record_path: a JSONL file the measurement (max and mean |Δlogprob| over every compared logprob,
            ``record``'s fields, ``device``) is appended to before any assertion, so a failing run still
            records what it measured (the GPU runs' tolerance rows).
        base_quant: the model's base storage ("fp8_block": the w8a8 rows, ``tolerance.FP8_LOGPROB_TOLERANCES``).

    Returns:
        (max, mean) |Δlogprob|.

    Raises:
        AssertionError: a request id, finish reason or greedy token differs, or a logprob is out of
            tolerance (the message names the request and the first differing position).
    """
    tol = logprob_tolerance(comparison, dtype, base_quant=base_quant).max_abs
    items = []
    for a, b in zip(got, want, strict=True):
        assert a.request_id == b.request_id and a.finish_reason == b.finish_reason, \
            (f"{what}: request {a.request_id} finished {a.finish_reason!r} ({a.error}), "
             f"the reference run's {b.request_id} {b.finish_reason!r}")
        agree = len(b.output_token_ids)
        if b.top_logprobs:
            margins = [t[0]["logprob"] - t[1]["logprob"] for t in b.top_logprobs]
            agree = next((j for j, m in enumerate(margins) if m <= 2 * tol), agree)
        assert a.output_token_ids[:agree] == b.output_token_ids[:agree], \
            (f"{what}: request {a.request_id} tokens {a.output_token_ids[:agree]} != {b.output_token_ids[:agree]} "
             f"(the first {agree} have a clear top-2 margin)")
        if b.prompt_logprobs is not None:
            items.append((a.prompt_logprobs[1:], b.prompt_logprobs[1:], f"{a.request_id} prompt logprobs"))
        items.append((a.output_logprobs[:agree], b.output_logprobs[:agree], f"{a.request_id} output logprobs"))
    diffs = [abs(x - y) for mine, theirs, _ in items for x, y in zip(mine, theirs)]
    measured = (max(diffs, default=0.0), sum(diffs) / max(1, len(diffs)))
    if record_path:
        with open(record_path, "a") as fh:
            fh.write(json.dumps({"what": what, "dtype": dtype, "device": device, "count": len(diffs),
                                 "max_abs": measured[0], "mean_abs": measured[1], **(record or {})}) + "\n")
    check = LogprobCheck(comparison, dtype, base_quant=base_quant)
    for mine, theirs, name in items:
        check.add(mine, theirs, what=f"{what} {name}")
    check.finish(what)
    return measured


# --- HF + PEFT, run as-is ---------------------------------------------------------------------------


@dataclass
class TeacherForced:
    """HF + PEFT on one sequence: per position p >= 1, the logprob of token p, and per output step the
    reference's argmax and top-2 margin."""

    logprobs: list[float]
    argmax: list[int]
    margins: list[float]


class HFReference:
    """transformers + peft models of one model directory, one per adapter (peft cannot mix expert
    adapters in one batch), loaded on first use, fp32, eval mode, on the CPU. Teacher-forced results
    are cached by (adapter, tokens), so several engine modes with the same outputs cost one HF run.

    Args:
        model_dir: the HF checkpoint. adapter_dirs: adapter name → PEFT directory.
        w8a8: ``model_dir`` is fp8 block-scaled and its fp8 modules compute w8a8, the LoRA deltas on the
            unquantized activations (``hf_check.hf_w8a8``: transformers on a CPU computes it w8a16).
    """

    def __init__(self, model_dir: Path, adapter_dirs: dict[str, Path], *, w8a8: bool = False) -> None:
        self.model_dir = Path(model_dir)
        self.adapter_dirs = dict(adapter_dirs)
        self.w8a8 = w8a8
        self._models: dict[str | None, object] = {}
        self._cache: dict[tuple, TeacherForced] = {}

    def model(self, adapter: str | None):
        if adapter not in self._models:
            from moelora_conformance.hf_check.hf_model import load_hf

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._models[adapter] = load_hf(self.model_dir, None if adapter is None else self.adapter_dirs[adapter],
                                                w8a8=self.w8a8)
        return self._models[adapter]

    def teacher_forced(self, adapter: str | None, tokens: Sequence[int], prompt_len: int) -> TeacherForced:
        key = (adapter, tuple(tokens), prompt_len)
        if key not in self._cache:
            self._cache[key] = _teacher_forced(self.model(adapter), tokens, prompt_len)
        return self._cache[key]

    def crossing(self, adapter: str | None, tokens: Sequence[int], prompt_len: int, logprobs: Sequence[float],
                 max_abs: float):
        """Why the engine's ``logprobs`` (of tokens[1:]) depart from this w8a8 model's: the e4m3 crossings (one,
        at most ``fp8_crossings.MOST_CROSSINGS``) whose flip makes the model reproduce them within ``max_abs``
        (``hf_check.fp8_crossings.find_crossing``), and the model's :class:`TeacherForced` under them; None
        when there are none (or ``w8a8`` is off)."""
        if not self.w8a8:
            return None
        from moelora_conformance.hf_check.fp8_crossings import find_crossing

        return find_crossing(self.model(adapter), tokens, logprobs,
                             self.teacher_forced(adapter, tokens, prompt_len).logprobs,
                             lambda out: _from_logits(out.logits, tokens, prompt_len), max_abs)


@torch.no_grad()
def _teacher_forced(model, tokens: Sequence[int], prompt_len: int) -> TeacherForced:
    return _from_logits(model(torch.tensor([list(tokens)])).logits, tokens, prompt_len)


def _from_logits(logits: torch.Tensor, tokens: Sequence[int], prompt_len: int) -> TeacherForced:
    """The :class:`TeacherForced` of ``logits`` [1, len(tokens), V] (a forward on ``tokens``)."""
    logits = logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    logprobs = [float(lp[p - 1, tokens[p]]) for p in range(1, len(tokens))]
    steps = range(prompt_len - 1, len(tokens))
    top2 = [torch.topk(lp[p], 2).values for p in steps]
    return TeacherForced(logprobs, [int(lp[p].argmax()) for p in steps], [float(v[0] - v[1]) for v in top2])


class PerModuleReference(HFReference):
    """Like :class:`HFReference`, but each adapter is the transformers model with the file's own
    per-module deltas merged into its weights (``hf_check.per_module.merged_reference_model``): the
    reference for adapters peft cannot load (shared-outer / fully shared expert LoRA) or serves with
    other σ. Same API; base requests run the plain model. Not for an fp8 base (``w8a8``): a delta merged
    into the weights would read the quantized activations."""

    def __init__(self, model_dir: Path, adapter_dirs: dict[str, Path], *, w8a8: bool = False) -> None:
        if w8a8:
            raise ValueError("PerModuleReference merges each delta into its weight: it cannot keep the LoRA path "
                             "on the unquantized activations of a w8a8 base (DESIGN.md §1)")
        super().__init__(model_dir, adapter_dirs)

    def model(self, adapter: str | None):
        if adapter not in self._models:
            from moelora_conformance.hf_check.hf_model import load_hf
            from moelora_conformance.hf_check.per_module import merged_reference_model

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                base = load_hf(self.model_dir, None)
                self._models[adapter] = base if adapter is None else \
                    merged_reference_model(base, Path(self.adapter_dirs[adapter])).eval()
        return self._models[adapter]


def greedy_agreement(tokens: list[int], ref: TeacherForced, tol: float) -> int:
    """Number of output tokens compared: tokens must equal the reference's argmax up to (excluding) the
    first step whose top-2 margin is at most ``2 * tol`` (there a flip is within tolerance; HF's greedy
    continuation of the same prefix would be the same up to that step).

    Raises:
        AssertionError: a token differs where the margin is clear.
    """
    for j, token in enumerate(tokens):
        if ref.margins[j] <= 2 * tol:
            return j
        assert token == ref.argmax[j], (f"output token {j}: engine {token}, HF+PEFT {ref.argmax[j]} "
                                        f"(top-2 margin {ref.margins[j]:.3g})")
    return len(tokens)


#: At most this share of a comparison's requests (and at least one) are searched for an e4m3 crossing
#: that explains their departure (:func:`check_against_hf`): crossings are rare (one in 16-64 requests
#: measured, ``tolerance._FP8_LOGPROB_NOTE``), so more departures are a systematic difference to report.
SET_ASIDE_SHARE = 0.25


def _departs(logprobs: list[float], ref: TeacherForced, tokens: list[int], tol) -> bool:
    """``logprobs`` leave ``tol``'s max against ``ref``, or ``tokens`` (greedy) leave its argmax where the
    margin is clear."""
    diffs = [abs(a - b) for a, b in zip(logprobs, ref.logprobs)]
    if len(logprobs) != len(ref.logprobs) or not diffs:
        return False  # LogprobCheck.add names it
    if max(diffs) > tol.max_abs:
        return True
    try:
        greedy_agreement(tokens, ref, tol.max_abs)
    except AssertionError:
        return True
    return False


def check_against_hf(outputs, requests: list[dict], hf: HFReference, *, dtype: str = "float32",
                     what: str = "engine vs HF+PEFT") -> dict[str, int]:
    """Every output's prompt and output logprobs within the ``engine_vs_hf`` row (each within max_abs,
    all of them on average within mean_abs) and its greedy tokens equal where the margin allows. A w8a8
    reference (``hf.w8a8``) takes the fp8 block-scaled base's row (``tolerance.FP8_LOGPROB_TOLERANCES``),
    and a request that leaves it is set aside when e4m3 crossings explain it (:meth:`HFReference.crossing`):
    it is then held to the same row against the reference with those crossings flipped, and named. Searched,
    at most :data:`SET_ASIDE_SHARE` of the requests: first those that leave the max or the greedy tokens
    (:func:`_departs`; explained = reproduced within the max); then, while the comparison's mean is over its
    bound, those that add most to it among the requests with a visible move (a crossing's size,
    ``fp8_crossings.VISIBLE``; explained = reproduced within that, a stricter proof: one crossing under the
    max can carry a short workload's whole mean, as on an H100 where a base request's one crossing gave
    96 % of it).

    Returns:
        {"tokens": greedy output tokens, "compared": those compared, "logprobs": logprobs compared,
        "max_abs": the largest |Δlogprob|, "mean_abs": their mean, and, when any, "set_aside": one line
        per request set aside (request, adapter, the crossing: module, token, element, x/s, midpoint)}.

    Raises:
        AssertionError: a request did not finish, a token or a logprob differs (named).
    """
    w8a8 = getattr(hf, "w8a8", False)
    quant = "fp8_block" if w8a8 else "none"
    tol = logprob_tolerance("engine_vs_hf", dtype, base_quant=quant)
    check = LogprobCheck("engine_vs_hf", dtype, base_quant=quant)
    total = compared = count = 0
    set_aside: list[str] = []
    searches = max(1, int(SET_ASIDE_SHARE * len(requests)))
    rows = []  # per request: name, tokens, prompt length, the engine's logprobs, greedy, the reference, label
    for req, out in zip(requests, outputs, strict=True):
        assert out.finish_reason in ("stop", "length"), f"{req['request_id']} finished {out.finish_reason}: {out.error}"
        prompt, name = req["prompt_token_ids"], f"{req['request_id']} ({req.get('adapter') or 'base'})"
        tokens = prompt + out.output_token_ids
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt), \
            f"{req['request_id']}: {len(out.prompt_logprobs)} prompt logprobs for {len(prompt)} prompt tokens"
        rows.append({"name": name, "adapter": req.get("adapter"), "tokens": tokens, "prompt": len(prompt),
                     "mine": out.prompt_logprobs[1:] + out.output_logprobs, "out": out.output_token_ids,
                     "greedy": req.get("temperature", 0.0) == 0.0,
                     "ref": hf.teacher_forced(req.get("adapter"), tokens, len(prompt)), "label": ""})

    def search(row, max_abs: float) -> None:
        found = hf.crossing(row["adapter"], row["tokens"], row["prompt"], row["mine"], max_abs)
        if found is not None:
            crossings, row["ref"] = found
            row["label"] = " with its e4m3 crossings flipped"
            set_aside.append(f"{row['name']}: {len(crossings)} e4m3 crossing{'s' * (len(crossings) > 1)}: "
                             + "; ".join(c.line() for c in crossings))
        else:  # a failure then says the search ran (its reach: hf_check.fp8_crossings.find_crossing)
            row["searched_note"] = " (searched for e4m3 crossings: none reproduces it)"

    if w8a8:
        # the crossings proven by flipping them (hf_check.fp8_crossings); at most SET_ASIDE_SHARE of the
        # requests are searched, so a fault cannot hide among them
        for row in rows:
            if searches and _departs(row["mine"], row["ref"], row["out"] if row["greedy"] else [], tol):
                searches -= 1
                row["searched"] = True
                search(row, tol.max_abs)
        from moelora_conformance.hf_check.fp8_crossings import VISIBLE

        def diffs(row) -> list[float]:
            return [abs(a - b) for a, b in zip(row["mine"], row["ref"].logprobs)]

        share = {id(r): sum(d) for r in rows if (d := diffs(r)) and max(d) > VISIBLE and not r.get("searched")}
        n = sum(len(r["mine"]) for r in rows)
        total = sum(sum(diffs(r)) for r in rows)
        # a request the first pass searched is not searched again; the mean is held from MEAN_MIN_SAMPLES on
        for row in sorted((r for r in rows if id(r) in share), key=lambda r: -share[id(r)]):
            if n < MEAN_MIN_SAMPLES or not searches or total <= tol.mean_abs * n:
                break
            searches -= 1
            search(row, VISIBLE)
            if row["label"]:  # set aside: its share is now its residual against the flipped reference
                total += sum(diffs(row)) - share[id(row)]
    for row in rows:
        check.add(row["mine"], row["ref"].logprobs,
                  what=f"{row['name']} logprobs{row['label']}{row.get('searched_note', '')}")
        try:
            agreed = greedy_agreement(row["out"], row["ref"], tol.max_abs) if row["greedy"] else 0
        except AssertionError as exc:
            raise AssertionError(f"{what}: {row['name']}{row['label']} {exc}") from None
        count += len(row["mine"])
        if row["greedy"]:
            compared += agreed
            total += len(row["out"])
    check.finish(what)
    return {"tokens": total, "compared": compared, "logprobs": count, "max_abs": check.max_abs,
            "mean_abs": check.mean_abs, **({"set_aside": set_aside} if set_aside else {})}
