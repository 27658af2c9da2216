"""The measurement behind the fp8 logprob rows (``moelora_core.tolerance.FP8_LOGPROB_TOLERANCES``): how far
e4m3 midpoint crossings move a w8a8 model's logprobs, and how far the known faults move them.

Two w8a8 computations whose fp8 modules' unquantized inputs differ by a rounding (another matmul
shape, another summation order) quantize an element to different e4m3 values wherever the difference
straddles a rounding midpoint: a whole e4m3 step, not a rounding error. To see what such crossings do
to the logprobs with nothing else different, :func:`measure` runs transformers' model made w8a8
(``hf_w8a8.make_w8a8``, peft on top) against itself with its embedding output perturbed by one fp32
rounding (:func:`perturbed_embeddings`: each element times 1 + 2^-23 u, u uniform in [-1, 1), computed
in fp64 and rounded once to fp32), on random token sequences, the base model and each adapter. The same
perturbation of the w8a16 model (no activation quantization) shows the roundings alone; the faults the
rows must fail are measured on the same sequences, unperturbed: the expert deltas reading the quantized
activations x̂ (the scales applied; ``hf_w8a8.w8a8_experts_forward(..., quantized_deltas=True)``), and
the w8a16 base (transformers' model as it loads on a CPU).

Run: ``python -m moelora_conformance.hf_check.fp8_crossings --fixtures DIR --model M --adapter NAME`` (one
line per measurement: logprobs, max, mean, median, how many over 1e-4).

The same event, found and undone: :func:`near_midpoints` lists the elements of a w8a8 model's quantized
inputs (every activation quantization ``hf_w8a8`` makes, named by module and token) whose fp32 quotient
x / s lies near an e4m3 rounding midpoint (within :data:`MIDPOINT_RADIUS` of its row's largest |x|), and
:func:`flipped_forward` runs the model with some of them rounded to the e4m3 value on the midpoint's
other side. E02 on an fp8 base (``e2e.engine_checks.check_against_hf``) sets a departing request aside
only when such flips (:func:`find_crossing`: at most :data:`MOST_CROSSINGS`) make the model reproduce
the engine's logprobs within the row: the departure is then proven to be those crossings, which a
fault (a systematic difference, at every position it touches) cannot be.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

#: Relative size of the embedding perturbation: one fp32 rounding (the unit roundoff's double, 2^-23).
EMBEDDING_NOISE = 2.0 ** -23
#: The documented sample: sequences per model and their lengths in tokens (inclusive).
SEQUENCES = 24
LENGTHS = (20, 200)
#: A logprob move above this counts as a crossing's (roundings alone stay under 2e-6).
VISIBLE = 1e-4
#: How near an element x must lie to s times an e4m3 rounding midpoint to be flipped, in units of the
#: largest |x| of its row (the token's input: two correct computations' inputs differ by roundings of
#: sums of that size, not of x, which may be a small difference of large terms): 2^-16, ~128 fp32 ulps
#: of it (the crossing e2e.locate named on deepseek_v3_fp8 differed by 1.35e-7 absolute).
MIDPOINT_RADIUS = 2.0 ** -16
#: The candidates :func:`find_crossing` tries (each one forward of the model, only for a request that
#: departs), pass by pass: n of them, the nearest to their midpoints, and the n nearest among the n positions
#: before the departure. The first pass is cheap and explains most departures; a crossing can also lie far
#: behind the departure it causes, behind many nearer candidates (in a GPU's fp32 E02 on qwen2_moe_fp8 one
#: lay 38 positions back, behind more than 8 nearer ones), which only the second pass reaches
#: (test_fp8_crossings.py::test_a_crossing_far_behind_its_departure_is_found).
PASSES = (8, 48)


@dataclass
class Moves:
    """|Δlogprob| of one measurement over every compared logprob (natural log)."""

    what: str
    count: int
    max_abs: float
    mean_abs: float
    median_abs: float
    over: int  # how many above VISIBLE

    def line(self) -> str:
        return (f"{self.what}: {self.count} logprobs, max {self.max_abs:.3g}, mean {self.mean_abs:.3g}, "
                f"median {self.median_abs:.3g}, {self.over} over {VISIBLE:g}")


def moves(what: str, got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> Moves:
    """The :class:`Moves` of ``got`` against ``want`` (lists of per-sequence logprob tensors, same shapes)."""
    diffs = torch.cat([(g - w).abs().flatten() for g, w in zip(got, want, strict=True)]).double()
    return Moves(what, int(diffs.numel()), float(diffs.max()), float(diffs.mean()),
                 statistics.median(diffs.tolist()), int((diffs > VISIBLE).sum()))


@contextmanager
def perturbed_embeddings(model: torch.nn.Module, seed: int, noise: float = EMBEDDING_NOISE) -> Iterator[None]:
    """Within the block, ``model``'s input embedding output e becomes fp32(e · (1 + noise · u)) with u uniform
    in [-1, 1) (fp64, seeded by ``seed`` and the call's order): by default one fp32 rounding of noise."""
    embed = model.get_input_embeddings()
    gen = torch.Generator().manual_seed(seed)

    def hook(module, args, out):
        u = torch.rand(out.shape, generator=gen, dtype=torch.float64) * 2 - 1
        return (out.double() * (1 + noise * u)).to(out.dtype)

    handle = embed.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def random_sequences(vocab: int, n: int = SEQUENCES, lengths: tuple[int, int] = LENGTHS,
                     seed: int = 0) -> list[list[int]]:
    """``n`` random token sequences of ``lengths[0]`` to ``lengths[1]`` tokens (inclusive)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
        out.append(torch.randint(0, vocab, (length,), generator=gen).tolist())
    return out


@torch.no_grad()
def teacher_forced(model: torch.nn.Module, tokens: Sequence[int]) -> torch.Tensor:
    """[len(tokens) - 1] fp64: the logprob of each token p >= 1 given the tokens before it."""
    logits = model(torch.tensor([list(tokens)])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[torch.arange(len(tokens) - 1), torch.tensor(list(tokens[1:]))]


def with_quantized_expert_deltas(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (made w8a8) with every fp8 experts module's deltas reading x̂ instead of x (the fault the
    fp8 rows must fail), in place; returns ``model``.

    Raises:
        ValueError: ``model`` has no w8a8 experts module (nothing to make faulty).
    """
    from moelora_conformance.hf_check.hf_w8a8 import w8a8_experts_forward

    found = [m for m in model.modules() if hasattr(m, "_w8a8_block_k")]
    if not found:
        raise ValueError("no w8a8 experts module (hf_w8a8.make_w8a8 not applied, or no fp8 experts)")
    for m in found:
        m.forward = functools.partial(w8a8_experts_forward, m, quantized_deltas=True)
    return model


@dataclass(frozen=True)
class Crossing:
    """One activation element of a w8a8 forward whose fp32 quotient x / s lies near an e4m3 rounding
    midpoint: at sequence position ``token``, ``element`` of the input of every module in ``where`` (one
    value quantized by each: q, k and v read one input, a token's routed experts one x); the quotient,
    the midpoint, the e4m3 value it rounds to and the one across the midpoint (``other``)."""

    token: int
    element: int
    quotient: float
    midpoint: float
    rounded: float
    other: float
    distance: float  # |x - s · midpoint| over |s · midpoint| or max |x| of its row, the smaller
    where: tuple[str, ...] = ()

    def line(self) -> str:
        return (f"{' / '.join(self.where)}, token {self.token}, element {self.element}: x/s {self.quotient:.9g}, "
                f"{self.distance:.2g} (relative) from the e4m3 midpoint {self.midpoint:g}, rounded to "
                f"{self.other:g} instead of {self.rounded:g}")


@torch.no_grad()
def flipped_forward(model: torch.nn.Module, tokens: Sequence[int], flips: Sequence[Crossing] = (),
                    record=None) -> tuple[object, int]:
    """``model`` (made w8a8, ``hf_w8a8.make_w8a8``) on ``tokens`` with each of ``flips`` rounded to its
    ``other`` wherever its module input, token and quotient recur, nothing else differently; and
    ``record(where, quotients [R, K], s / max |x| of the row [R, K], tokens [R], rounded [R, K])`` called on
    every activation quantization.
    Returns (the model's output, how many of ``flips`` were applied).

    Raises:
        RuntimeError: called within another one (``hf_w8a8`` has one tap).
    """
    from moelora_conformance.hf_check import hf_w8a8
    from moelora_reference.oracle import e4m3_round

    applied: set[int] = set()

    def tap(where, v, quot, s, v_hat, rows_tokens):
        if record is not None:
            record(where, quot, s * v.abs().amax(-1, keepdim=True).reciprocal(), rows_tokens, e4m3_round(quot))
        for n, c in enumerate(flips):
            if where in c.where:
                for r in (rows_tokens == c.token).nonzero().flatten().tolist():
                    if float(quot[r, c.element]) == c.quotient:  # else another flip moved it: not applied
                        v_hat = v_hat.clone()
                        v_hat[r, c.element] = c.other * float(s[r, c.element])
                        applied.add(n)
        return v_hat

    if hf_w8a8._TAP is not None:
        raise RuntimeError("flipped_forward: hf_w8a8 already has a tap")
    hf_w8a8._TAP = tap
    try:
        out = model(torch.tensor([list(tokens)]))
    finally:
        hf_w8a8._TAP = None
    return out, len(applied)


def near_midpoints(model: torch.nn.Module, tokens: Sequence[int], *, before: int | None = None,
                   radius: float = MIDPOINT_RADIUS, flips: Sequence[Crossing] = ()) -> list[Crossing]:
    """Every activation element x of ``model`` (made w8a8) on ``tokens`` (with ``flips`` applied) within
    ``radius`` · max |x of its row| of s times an e4m3 rounding midpoint, at sequence positions before ``before``
    (all by default), in forward order; one :class:`Crossing` per value (its quantizations by several
    modules merged: the same position, element and quotient)."""
    from moelora_reference.oracle import e4m3_from_ordinal, e4m3_ordinal

    found: dict[tuple[int, int, float], Crossing] = {}

    def record(where, quot, unit, rows_tokens, q):
        side = torch.sign(quot - q)
        other = e4m3_from_ordinal(e4m3_ordinal(q) + side.to(torch.int64))  # the e4m3 value across the midpoint
        mid = (q + other) / 2
        # relative to x itself or to its row's largest |x|, whichever is nearer: the roundings two
        # computations differ by scale with x (a product) or with the row (a sum of larger terms)
        distance = torch.minimum((quot - mid).abs() / mid.abs(), (quot - mid).abs() * unit)
        near = (side != 0) & (distance <= radius)
        if before is not None:
            near &= (rows_tokens < before)[:, None]
        for r, j in near.nonzero().tolist():
            key = (int(rows_tokens[r]), j, float(quot[r, j]))
            c = found.get(key) or Crossing(*key, float(mid[r, j]), float(q[r, j]), float(other[r, j]),
                                           float(distance[r, j]))
            found[key] = replace(c, where=c.where + (where,) * (where not in c.where))

    flipped_forward(model, tokens, flips, record)
    return list(found.values())


#: At most this many crossings may explain one request (two were seen in one 151-token request of
#: deepseek_v3_fp8's 64-request E02; each is rare, so more is a systematic difference).
MOST_CROSSINGS = 3


def find_crossing(model: torch.nn.Module, tokens: Sequence[int], actual: Sequence[float], expected: Sequence[float],
                  logprobs, max_abs: float, *, passes: Sequence[int] = PASSES, most: int = MOST_CROSSINGS):
    """The e4m3 crossings (at most ``most``) that explain why ``actual`` (logprobs of tokens[1:], another
    computation's) departs from ``expected`` (``model``'s own), found one at a time: of the n elements
    nearest to a midpoint (:func:`near_midpoints`, those found before flipped) at positions up to the first
    departure beyond ``max_abs`` and the n nearest within n positions before it, the one whose flip moves
    that departure furthest; n is each of ``passes`` in turn (a whole search each) until one explains it.
    The set is accepted once ``logprobs(output)`` (``model``'s output on ``tokens`` with them flipped → an
    object with ``.logprobs``) agrees with ``actual`` within ``max_abs`` everywhere (the caller holds it to
    its mean bound). Returns (crossings, that ``logprobs`` result), or None."""

    def first_departure(values) -> int:
        return next((i for i, (a, e) in enumerate(zip(actual, values, strict=True)) if abs(a - e) > max_abs),
                    len(actual))

    def search(n: int):
        flips: list[Crossing] = []
        first = first_departure(expected)
        while len(flips) < most:
            # the logprob of token i + 1 reads position i: a crossing at position t moves those from index t
            # on, mostly from t itself. Tried: the elements nearest to their midpoint (a crossing's lies within
            # roundings of it, ~1e-7 of its row, the others anywhere in the radius) at every position up to
            # the departure, and those at the n positions before it (a long sequence has many candidates)
            near = sorted(near_midpoints(model, tokens, before=first + 1, flips=flips), key=lambda c: c.distance)
            tried = list(dict.fromkeys(near[:n] + [c for c in near if c.token >= first - n][:n]))
            best: tuple[int, Crossing | None] = (first, None)
            for crossing in tried:
                out, applied = flipped_forward(model, tokens, [*flips, crossing])
                if applied < len(flips) + 1:
                    continue
                result = logprobs(out)
                moved_to = first_departure(result.logprobs)
                if moved_to == len(actual):
                    return [*flips, crossing], result
                best = max(best, (moved_to, crossing), key=lambda b: b[0])
            if best[1] is None:  # no flip moves the departure: not crossings
                return None
            first, flips = best[0], [*flips, best[1]]
        return None

    return next((found for n in passes if (found := search(n)) is not None), None)


def mean_move(outputs, requests: list[dict], reference, *, adapters_only: bool = False) -> float:
    """Mean |Δlogprob| of the engine's ``outputs`` (``RequestOutput``: prompt and output logprobs) against
    ``reference`` (``e2e.engine_checks.HFReference`` or alike) teacher-forced on the same tokens, over every
    request of ``requests`` (only those with an adapter when ``adapters_only``): what a fault moves on
    average, held to the fp8 rows' mean bound, with no max bound stopping the count first.

    Raises:
        ValueError: no logprob to average.
    """
    diffs = []
    for req, out in zip(requests, outputs, strict=True):
        if adapters_only and req.get("adapter") is None:
            continue
        prompt = req["prompt_token_ids"]
        ref = reference.teacher_forced(req.get("adapter"), prompt + out.output_token_ids, len(prompt))
        diffs += [abs(a - b) for a, b in zip(out.prompt_logprobs[1:] + out.output_logprobs, ref.logprobs, strict=True)]
    if not diffs:
        raise ValueError("no logprobs to compare (no request, or no request with an adapter)")
    return sum(diffs) / len(diffs)


def measure(model_dir: Path, adapter_dirs: dict[str, Path], *, n: int = SEQUENCES,
            lengths: tuple[int, int] = LENGTHS, seed: int = 0, noise: float = EMBEDDING_NOISE) -> list[Moves]:
    """The module doc's measurements on the fp8 checkpoint ``model_dir``, the base model and each adapter of
    ``adapter_dirs`` (name → PEFT directory) on the same ``n`` random sequences.

    Returns:
        [w8a8 self-perturbation, w8a16 self-perturbation, fault: expert deltas on x̂ (adapters only; absent
        without adapters), fault: w8a16 base], each over every (model, sequence).
    """
    from moelora_conformance.hf_check.hf_model import load_hf
    from moelora_core.checkpoint import read_model_config

    cfg = read_model_config(Path(model_dir))
    seqs = random_sequences(cfg.vocab_size, n, lengths, seed)
    got: dict[str, list[torch.Tensor]] = {k: [] for k in ("w8a8", "w8a8~", "w8a16", "w8a16~", "x̂ deltas")}
    adapter_lp: dict[str, list[torch.Tensor]] = {"w8a8": [], "x̂ deltas": []}
    for name in (None, *adapter_dirs):
        adapter = None if name is None else Path(adapter_dirs[name])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            w8a8, w8a16 = load_hf(model_dir, adapter, w8a8=True), load_hf(model_dir, adapter)
        for label, model in (("w8a8", w8a8), ("w8a16", w8a16)):
            with perturbed_embeddings(model, seed + 1, noise):
                got[label + "~"] += [teacher_forced(model, s) for s in seqs]
            got[label] += [teacher_forced(model, s) for s in seqs]
        if name is not None:
            adapter_lp["w8a8"] += got["w8a8"][-len(seqs):]
            faulty = with_quantized_expert_deltas(w8a8)  # in place: w8a8's last use
            adapter_lp["x̂ deltas"] += [teacher_forced(faulty, s) for s in seqs]
    out = [moves("w8a8 self-perturbation", got["w8a8~"], got["w8a8"]),
           moves("w8a16 self-perturbation", got["w8a16~"], got["w8a16"])]
    if adapter_dirs:
        out.append(moves("fault: expert deltas on x̂", adapter_lp["x̂ deltas"], adapter_lp["w8a8"]))
    out.append(moves("fault: w8a16 base", got["w8a16"], got["w8a8"]))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """CLI (module doc). Returns the exit status."""
    from moelora_conformance.fixtures.manifest import load_fixtures

    p = argparse.ArgumentParser(prog="python -m moelora_conformance.hf_check.fp8_crossings",
                                description="e4m3 crossings vs faults on an fp8 fixture's HF + PEFT w8a8 model")
    p.add_argument("--fixtures", type=Path, required=True, help="a make-fixtures directory")
    p.add_argument("--model", required=True, help="an fp8 fixture model (e.g. qwen3_moe_fp8)")
    p.add_argument("--adapter", action="append", default=[], help="a fixture adapter of its source model")
    p.add_argument("--sequences", type=int, default=SEQUENCES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise", type=float, default=EMBEDDING_NOISE, help="relative size of the perturbation")
    args = p.parse_args(argv)
    fixtures = load_fixtures(args.fixtures)
    adapters = {a: fixtures.adapter_dir(a) for a in args.adapter}
    for m in measure(fixtures.model_dir(args.model), adapters, n=args.sequences, seed=args.seed,
                     noise=args.noise):
        print(f"{args.model}: {m.line()}", flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
