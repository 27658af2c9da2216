"""Expected-failure manifests: what a backend knows it fails, in TOML, matched to the suite's
property × mode × dtype items (DESIGN.md §7).

::

    # moelora manifest for my backend
    [[expected_failure]]
    property = "P05"          # a stable property id (required)
    mode = "decode"           # a harness mode; "*" or absent = every mode
    dtype = "fp16"            # "fp32" / "fp16" / "bf16"; "*" or absent = every dtype
    reason = "decode replay reads a segment count frozen at capture"   # required

Every matching item becomes ``xfail(strict=True)``: it must fail, and a pass is reported as a
failure (the manifest is stale). An entry that matches no collected item is reported with a
warning (a typo, or a property the backend no longer runs).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from moelora_conformance.strategies.suite import FAMILY_MODES, LAYER_MODES
from moelora_core.errors import InvalidFieldError

DTYPE_NAMES = ("fp32", "fp16", "bf16")
_ANY = "*"


@dataclass(frozen=True)
class ExpectedFailure:
    """One manifest entry.

    Attributes:
        property: property id. mode: harness mode or "*". dtype: dtype name or "*". reason: why.
        index: position in the file (for messages).
    """

    property: str
    mode: str
    dtype: str
    reason: str
    index: int

    def matches(self, property_id: str, mode: str, dtype: str) -> bool:
        return (self.property == property_id and self.mode in (_ANY, mode) and self.dtype in (_ANY, dtype))

    def describe(self) -> str:
        return f"expected_failure[{self.index}] (property={self.property} mode={self.mode} dtype={self.dtype})"


@dataclass(frozen=True)
class Manifest:
    """A parsed manifest.

    Attributes:
        path: the file, or None for the empty manifest. entries: its expected failures.
    """

    path: Path | None
    entries: tuple[ExpectedFailure, ...]

    def match(self, property_id: str, mode: str, dtype: str) -> ExpectedFailure | None:
        """The first entry matching the item, or None."""
        return next((e for e in self.entries if e.matches(property_id, mode, dtype)), None)


EMPTY = Manifest(None, ())


def load_manifest(path: str | Path | None, known_properties: set[str],
                  known_modes: set[str] | None = None) -> Manifest:
    """Parse and validate a manifest (``None`` = the empty manifest).

    ``known_modes`` are the modes an entry may name (default the layer suite's harness modes and
    graph families; the e2e suite passes its engine modes).

    Raises:
        InvalidFieldError: unreadable TOML, unknown keys, an unknown property / mode / dtype, or a
            missing reason — naming the entry.
    """
    if path is None:
        return EMPTY
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidFieldError("manifest", f"cannot read {path}: {exc}") from exc
    unknown_top = set(data) - {"expected_failure"}
    if unknown_top:
        raise InvalidFieldError("manifest", f"{path}: unknown tables/keys {sorted(unknown_top)}; "
                                            "expected [[expected_failure]] entries")
    raw = data.get("expected_failure", [])
    if not isinstance(raw, list):
        raise InvalidFieldError("manifest", f"{path}: expected_failure must be an array of tables ([[...]])")
    modes = (set(LAYER_MODES) | set(FAMILY_MODES) if known_modes is None else set(known_modes)) | {_ANY}
    entries = []
    for i, e in enumerate(raw):
        where = f"{path}: expected_failure[{i}]"
        if not isinstance(e, dict):
            raise InvalidFieldError("manifest", f"{where} must be a table")
        extra = set(e) - {"property", "mode", "dtype", "reason"}
        if extra:
            raise InvalidFieldError("manifest", f"{where}: unknown keys {sorted(extra)}")
        prop, mode, dtype = e.get("property"), e.get("mode", _ANY), e.get("dtype", _ANY)
        reason = e.get("reason")
        if prop not in known_properties:
            raise InvalidFieldError("manifest", f"{where}: unknown property {prop!r}; known {sorted(known_properties)}")
        if mode not in modes:
            raise InvalidFieldError("manifest", f"{where}: unknown mode {mode!r}; known {sorted(modes)}")
        if dtype not in (*DTYPE_NAMES, _ANY):
            raise InvalidFieldError("manifest", f"{where}: unknown dtype {dtype!r}; known {DTYPE_NAMES} or '*'")
        if not isinstance(reason, str) or not reason.strip():
            raise InvalidFieldError("manifest", f"{where}: needs a non-empty reason")
        entries.append(ExpectedFailure(prop, mode, dtype, reason.strip(), i))
    return Manifest(path, tuple(entries))
