"""DeepSeek-V3's routing faults (DESIGN.md §1), put back into the readers or the engine.

Routing belongs to the caller of a backend (the engine, or whoever reads the checkpoint), so these are
faults of the readers and the engine, not of a backend: each is a context manager that patches one of
them for the duration of a run. ``hf-check`` (the readers' rows), ``checkpoint-pass`` and the engine's
comparison with HF + PEFT (the e2e claim E01 on the family; ``test_engine_deepseek_v3.py``) must each
catch the faults that reach them (``conformance/docs/mutations.md``; ``test_routing_faults.py``):

- ``bias-in-weights`` (engine): the correction bias is added to the weights as well as the selection;
- ``no-group-limit`` (readers and engine): top-k over every expert, the group limit skipped;
- ``scaling-twice`` (readers and engine): ``routed_scaling_factor`` applied twice (read squared, or
  multiplied once more after the routing);
- ``scaling-on-shared`` (readers and engine): the shared experts' output scaled by
  ``routed_scaling_factor`` too (read into their down projection, or multiplied in the engine).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import torch

from moelora_core.routing import GroupLimitedRouting

#: Fault name → one line.
ROUTING_FAULTS: dict[str, str] = {
    "bias-in-weights": "the correction bias is added to the routing weights as well as to the selection",
    "no-group-limit": "experts are chosen among all groups (n_group and topk_group ignored)",
    "scaling-twice": "routed_scaling_factor is applied twice",
    "scaling-on-shared": "the shared experts' output is scaled by routed_scaling_factor too",
}
#: The faults a reader can hold (the bias only ever enters through the routing function).
READER_FAULTS: tuple[str, ...] = ("no-group-limit", "scaling-twice", "scaling-on-shared")


def _reader_routing(fault: str, routing: GroupLimitedRouting) -> GroupLimitedRouting:
    if fault == "no-group-limit":
        return GroupLimitedRouting(1, 1, routing.routed_scaling_factor)
    if fault == "scaling-twice":
        return replace(routing, routed_scaling_factor=routing.routed_scaling_factor ** 2)
    return routing


@contextlib.contextmanager
def faulty_reader(fault: str) -> Iterator[None]:
    """``MoECheckpoint`` reads DeepSeek-V3 layers with ``fault`` (one of :data:`READER_FAULTS`)."""
    from moelora_core.checkpoint import base_reader

    if fault not in READER_FAULTS:
        raise KeyError(f"{fault!r} is not a reader fault; expected one of {READER_FAULTS}")
    cls = base_reader.MoECheckpoint
    moe, shared = cls.moe, cls.shared_expert

    def faulty_moe(self, layer):
        block = moe(self, layer)
        if block is not None and block.routing is not None:
            block.routing = _reader_routing(fault, block.routing)
        return block

    def faulty_shared(self, layer):
        se = shared(self, layer)
        if fault == "scaling-on-shared" and se is not None and self.config.routing is not None:
            se = replace(se, down_proj=se.down_proj * self.config.routing.routed_scaling_factor)
        return se

    cls.moe, cls.shared_expert = faulty_moe, faulty_shared
    try:
        yield
    finally:
        cls.moe, cls.shared_expert = moe, shared


def make_engine_faulty(engine, fault: str) -> None:
    """Put ``fault`` into a DeepSeek-V3 ``engine``'s decoder layers (in place)."""
    from moelora_reference.routing import route_grouped_sigmoid

    if fault not in ROUTING_FAULTS:
        raise KeyError(f"unknown routing fault {fault!r}; expected one of {tuple(ROUTING_FAULTS)}")
    for layer in engine.model.layers:
        if layer.moe is None:
            continue
        routing, c = layer.moe.routing, layer.config
        bias = layer.moe.router_correction_bias

        def logits(m, layer=layer):
            return torch.nn.functional.linear(m.float(), layer.router.float())

        if fault == "bias-in-weights":
            def route(m, logits=logits, routing=routing, bias=bias, c=c):
                w, ids = route_grouped_sigmoid(logits(m), bias, c.top_k, routing, c.norm_topk_prob)
                return w + routing.routed_scaling_factor * bias[ids.long()], ids
        elif fault in ("no-group-limit", "scaling-twice"):
            wrong = _reader_routing(fault, routing)

            def route(m, logits=logits, routing=wrong, bias=bias, c=c):
                return route_grouped_sigmoid(logits(m), bias, c.top_k, routing, c.norm_topk_prob)
        else:  # scaling-on-shared
            route = layer.route
            se = layer.w.shared_expert
            layer.w.shared_expert = replace(se, down_proj=se.down_proj * routing.routed_scaling_factor)
        layer.route = route
