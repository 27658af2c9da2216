"""Canonical indices in checkpoint and adapter keys.

torch names the children of a ``ModuleList`` by ``str(index)``: ``model.layers.0``,
``mlp.experts.3``. transformers and peft match tensor keys against those names exactly, so a key
spelled ``layers.00`` or ``layers.١`` (an Arabic-Indic digit) names no module for them and is
ignored, while ``int()`` and a Unicode ``\\d`` read it as layer 0 or 1: next to the canonical key
it would name one tensor twice (an alias that silently overwrote the real factor). Both readers
refuse any key with a non-canonical index (a component of decimal digits that is not the ASCII
``str(int(component))``), the base reader with ``CheckpointFormatError``, the adapter reader with
``AdapterFormatError``.
"""

from __future__ import annotations


def canonical_key(key: str) -> str:
    """``key`` with every all-digit component written as torch names list indices (``"00"`` →
    ``"0"``, ``"١"`` → ``"1"``); equal to ``key`` when it is canonical already."""
    parts = key.split(".")
    # isdecimal() is exactly what int() accepts as digits (any script); isdigit() would also take "²".
    return ".".join(str(int(p)) if p.isdecimal() else p for p in parts)


def non_canonical(keys: list[str]) -> list[tuple[str, str]]:
    """(key, canonical form) of every key of ``keys`` with a non-canonical index, in order."""
    return [(k, c) for k in keys if (c := canonical_key(k)) != k]


def describe_non_canonical(bad: list[tuple[str, str]], *, present: set[str] | frozenset[str]) -> tuple[str, str]:
    """(subject, problem) for a refusal of ``bad`` (from :func:`non_canonical`); ``present`` is the
    set of all keys, to say when the canonical key is there too (one tensor named twice)."""
    shown = ", ".join(k for k, _ in bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
    key, canon = bad[0]
    twice = sum(c in present for _, c in bad)
    problem = (f"{len(bad)} key(s) with a non-canonical index (leading zeros or non-ASCII digits; "
               f"e.g. {key!r} for {canon!r}): module names carry plain ASCII indices, so transformers and peft "
               "would not load these keys")
    if twice:
        problem += f", and {twice} of them name a tensor the file also holds under its canonical key"
    return shown, problem
