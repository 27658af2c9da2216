"""Repro lines for failing properties: the seed, the batch structure and commands that replay them.

When a property fails, the plugin builds a :class:`Repro` from the running example's trace (the
case's ``describe()`` line and every batch the property ran), Hypothesis' seed of the run and the
choice sequence of the failing example (the ``@reproduce_failure`` blob Hypothesis prints), and two
one-line commands:

- **replay**: ``--profile repro`` with ``--moelora-replay VERSION:BLOB`` runs exactly the failing
  (shrunk) example once; ``--repro-caps`` names the failing run's profile, whose size caps the
  strategies must use to read the blob the same way. Hypothesis reports each *distinct* failure of
  an item (another exception type or place) with its own shrunk example: each gets its own replay
  line, and replays that failure only;
- **rerun**: the failing run's profile with ``--hypothesis-seed=SEED`` repeats the whole search
  (the same examples in the same order), then shrinks again. A derandomized run (on CI, or with
  a manifest) has no seed: its rerun is the same command under ``CI=true``, which derandomizes.
  Both carry the run's ``--max-examples`` (it changes the search) and ``--no-shrink`` (a run that did
  not shrink reports its first failing example, which a shrinking rerun would not); a failure under
  ``--profile repro`` (a replay) gets no rerun line.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass

_BLOB = re.compile(r"@reproduce_failure\('([^']+)', b'([^']+)'\)")


def extract_blob(exc: BaseException | None) -> tuple[str, str] | None:
    """(hypothesis version, blob) from the ``@reproduce_failure`` note Hypothesis attaches to a
    failure (``print_blob``), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        texts = [str(exc), *getattr(exc, "__notes__", ())]
        for text in texts:
            m = _BLOB.search(text)
            if m:
                return m.group(1), m.group(2)
        exc = exc.__cause__ or exc.__context__
    return None


def distinct_failures(exc: BaseException | None) -> list[BaseException]:
    """The failures Hypothesis reports in ``exc``: the members of its exception group ("N distinct
    failures"), each with its own example, or ``exc`` alone."""
    if exc is None:
        return []
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in distinct_failures(sub)]
    return [exc]


@dataclass(frozen=True)
class Repro:
    """How to replay one failing item (each of its distinct failures).

    Attributes:
        test: the test's name with its parameters (``test_x[decode-fp16]``).
        hypothesis_seed: the run's seed (``--hypothesis-seed``), if known.
        blob: "version:blob" of the (first) failing example, if Hypothesis reported it.
        trace: the (first) failing example's trace lines (case description first).
        replay: command running the (first) failing example once (needs ``blob``), or "".
        rerun: command repeating the run's search (with its seed, or under ``CI=true``), or "".
        replays: one replay command per distinct failure, in Hypothesis' order (``replay`` first).
        traces: the trace of each distinct failure's example, in the same order.
        messages: each distinct failure's first line, in the same order.
    """

    test: str
    hypothesis_seed: int | None
    blob: str | None
    trace: tuple[str, ...]
    replay: str
    rerun: str
    replays: tuple[str, ...] = ()
    traces: tuple[tuple[str, ...], ...] = ()
    messages: tuple[str, ...] = ()

    def text(self) -> str:
        lines = [f"moelora repro for {self.test}"]
        many = len(self.replays) > 1
        if many:
            lines.append(f"  {len(self.replays)} distinct failures, each with its own example:")
        for i, (replay, trace) in enumerate(zip(self.replays or (self.replay,), self.traces or (self.trace,))):
            if many:
                lines.append(f"  failure {i + 1}: {self.messages[i] if i < len(self.messages) else ''}")
            lines += [f"  {t}" for t in trace]
            if replay:
                lines.append(f"  replay the failing example: {replay}")
        if self.hypothesis_seed is not None:
            lines.append(f"  hypothesis seed: {self.hypothesis_seed}")
        if self.rerun:
            lines.append(f"  rerun the search:           {self.rerun}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["trace"] = list(self.trace)
        d["replays"] = list(self.replays)
        d["traces"] = [list(t) for t in self.traces]
        d["messages"] = list(self.messages)
        return d


def build_repro(*, test: str, backend: str, device: str, profile: str, caps_profile: str,
                hypothesis_seed: int | None, blob: tuple[str, str] | None = None,
                trace: list[str] | tuple[str, ...] = (), derandomized: bool = False,
                max_examples: int | None = None, blobs: list[tuple[str, str] | None] | None = None,
                traces: list[list[str]] | None = None, messages: list[str] | None = None,
                no_shrink: bool = False) -> Repro:
    """The :class:`Repro` of a failing item (commands quoted for a POSIX shell).

    Args:
        profile: the ``--profile`` of the failing run. caps_profile: the profile whose size caps it
            used (itself, or its ``--repro-caps``).
        blob, trace: the failing example's blob and trace (one failure); or
        blobs, traces, messages: one per distinct failure (several).
        derandomized: the run's search was derandomized (then a missing seed is expected, and the
            rerun line sets ``CI=true``).
        max_examples: the run's ``--max-examples`` override, if any.
        no_shrink: the run had ``--no-shrink``.
    """
    base = ["pytest", "-p", "moelora_conformance.plugin", "--backend", backend, "--device", device,
            "-k", test, "-p", "no:cacheprovider"]
    blobs = list(blobs) if blobs is not None else [blob]
    traces = [tuple(t) for t in traces] if traces is not None else [tuple(trace)]
    replays = tuple(
        shlex.join([*base, "--profile", "repro", "--repro-caps", caps_profile, "--moelora-replay", f"{b[0]}:{b[1]}"])
        if b else "" for b in blobs)
    blob_s = f"{blobs[0][0]}:{blobs[0][1]}" if blobs and blobs[0] else None
    replay = replays[0] if replays else ""
    caps = [] if caps_profile == profile else ["--repro-caps", caps_profile]
    budget = [] if max_examples is None else ["--max-examples", str(max_examples)]
    search = [*base, "--profile", profile, *caps, *budget, *(["--no-shrink"] if no_shrink else [])]
    if profile != "repro" and hypothesis_seed is not None:  # a replay (repro) has no search to repeat
        rerun = shlex.join([*search, f"--hypothesis-seed={hypothesis_seed}"])
    elif profile != "repro" and derandomized:
        rerun = "CI=true " + shlex.join(search)
    else:
        rerun = ""
    return Repro(test, hypothesis_seed, blob_s, traces[0] if traces else (), replay, rerun, replays,
                 tuple(traces), tuple(messages or ()))
