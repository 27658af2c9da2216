"""The property registry: stable ids, promises, modes.

Ids never change meaning: manifests, reports and support matrices key on them. The promise is the
test function's name (``test_<promise>``); the title is what the report prints.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from moelora_conformance.strategies.suite import FAMILY_MODES, LAYER_MODES

#: The marker the plugin parametrizes: ``moelora_property(id)``.
MARKER = "moelora_property"


@dataclass(frozen=True)
class Property:
    """One property of the suite.

    Attributes:
        id: stable id ("P01"..).
        title: the promise, in words.
        modes: harness modes it runs in (:data:`~moelora_conformance.strategies.suite.LAYER_MODES`
            or the graph families for family-level properties).
        capability: a ``Capabilities`` attribute it needs beyond the mode's (e.g. "virtual_experts").
        metadata_only: checks ``prepare`` and metadata alone (no forward): cheap and precise, so the
            plugin runs these first and a metadata fault is reported as one.
        requires: modules the property needs besides the suite's own dependencies (without them
            its items are reported ``not_run``, never passed).
    """

    id: str
    title: str
    modes: tuple[str, ...]
    capability: str | None = None
    metadata_only: bool = False
    requires: tuple[str, ...] = ()


_GRAPH_LAYER_MODES = tuple(m for m in LAYER_MODES if m != "eager")

PROPERTIES: dict[str, Property] = {p.id: p for p in (
    Property("P01", "every output row equals the oracle (ragged mixed batches up to the caps)", LAYER_MODES),
    Property("P02", "base rows are bit-identical to a LoRA-disabled run, whatever batch mates and history",
             LAYER_MODES),
    Property("P03", "permuting requests permutes outputs; a request's output ignores its batch mates", LAYER_MODES),
    Property("P04", "a batch after any history equals the same batch on a fresh backend", LAYER_MODES),
    Property("P05", "replay equals eager, a small batch right after a larger one, 1 to > 32 requests",
             _GRAPH_LAYER_MODES),
    Property("P06", "static-buffer addresses stay fixed; decode and prefill families share no storage",
             FAMILY_MODES, metadata_only=True),
    Property("P07", "metadata is exact: token mapping, per-request fields, segments, alignment, tails",
             ("eager", *FAMILY_MODES), metadata_only=True),
    Property("P08", "no host sync in prepare + forward", LAYER_MODES),
    Property("P09", "sentinel expert ids add nothing; IDLE batches launch nothing and leave no state", LAYER_MODES),
    Property("P10", "virtual experts equal the standard path", LAYER_MODES, capability="virtual_experts"),
    Property("P11", "mixed ranks, r < R, rsLoRA and different σ in one batch equal the oracle", LAYER_MODES),
    Property("P12", "over capacity, prepare returns Fallback, touches no static buffer, and eager is right",
             FAMILY_MODES),
    Property("P13", "adapters read from real PEFT files (fused, per-expert, rsLoRA, patterns, fp16) mean what "
             "their files say", LAYER_MODES, requires=("transformers", "peft", "safetensors")),
    Property("P14", "on an fp8 block-scaled base (w8a8) the delta is applied on every MoE path and base rows equal "
             "the quantized base alone", LAYER_MODES, capability="fp8_block_base"),
)}


#: The order the plugin runs items in, within each dtype (fp32 first: exact enough for every fault):
#: the metadata-only properties first (cheap, and a metadata fault is then reported as one), then
#: the eager items of the properties that catch the most faults per second — P01 (outputs), P04
#: (histories, reloads), P13 (adapter files), with P14 (fp8 base: one example runs every MoE path)
#: after P01 — then P05 (replays after a larger batch and after a
#: reload since the capture), P04 and P01 under graphs (faults a captured graph keeps: frozen σ,
#: rank bounds), the rest. ``(property, modes)``; ``"*"`` = every mode.
#: Seconds to each mutant's first counterexample: ``docs/mutations.md``.
RUN_ORDER: tuple[tuple[str, str], ...] = (
    ("P06", "*"), ("P07", "*"), ("P01", "eager"), ("P14", "eager"), ("P04", "eager"), ("P13", "eager"), ("P05", "*"),
    ("P04", "*"), ("P01", "*"), ("P13", "*"), ("P02", "*"), ("P03", "*"), ("P09", "*"), ("P11", "*"), ("P08", "*"),
    ("P10", "*"), ("P14", "*"), ("P12", "*"),
)
_DTYPE_ORDER = ("fp32", "fp16", "bf16")
_MODE_ORDER = (*LAYER_MODES, *FAMILY_MODES)


def run_order(property_id: str, mode: str, dtype: str) -> tuple[int, int, int, int]:
    """The sort key of an item (:data:`RUN_ORDER`)."""
    prop = PROPERTIES[property_id]
    position = next((i for i, (p, m) in enumerate(RUN_ORDER) if p == property_id and m in ("*", mode)),
                    len(RUN_ORDER))
    return (0 if prop.metadata_only else 1, _DTYPE_ORDER.index(dtype) if dtype in _DTYPE_ORDER else 9, position,
            _MODE_ORDER.index(mode) if mode in _MODE_ORDER else 9)


def conformance(property_id: str) -> Callable:
    """Decorate a ``@given`` test as property ``property_id``: the plugin parametrizes ``mode`` and
    ``dtype`` from the mark and applies the run's Hypothesis settings to it at collection (a
    ``conftest.py`` that loads another profile while pytest collects cannot change them).

    Raises:
        KeyError: an unknown id.
    """
    if property_id not in PROPERTIES:
        raise KeyError(f"unknown property id {property_id!r}; known: {sorted(PROPERTIES)}")
    return getattr(pytest.mark, MARKER)(property_id)


#: A property module is ``test_p<NN>_<promise>.py`` (the id's digits): how a node id names its property
#: where no item object is at hand (the xdist controller, a crashed worker's report).
_NODEID = re.compile(r"(?:^|/)test_p(\d\d)_\w+\.py::(\w+)(?:\[(.+)\])?$")


def item_fields(nodeid: str) -> dict[str, str] | None:
    """{property, title, mode, dtype, test} of a property item's node id, or None for other tests."""
    m = _NODEID.search(nodeid)
    if m is None or f"P{m[1]}" not in PROPERTIES or not m[3]:
        return None
    mode, _, dtype = m[3].rpartition("-")
    pid = f"P{m[1]}"
    return {"property": pid, "title": PROPERTIES[pid].title, "mode": mode, "dtype": dtype,
            "test": f"{m[2]}[{m[3]}]"}


def property_of(item: pytest.Item) -> Property | None:
    """The property of a collected test item, or None for other tests."""
    marker = item.get_closest_marker(MARKER)
    return PROPERTIES[marker.args[0]] if marker is not None else None
