"""Faulty backends (``module:factory`` targets) the e2e tests prove the e2e properties catch; each
breaks one rule of graph mode and is right eagerly.

- :func:`make_graph_delta_backend`: the reference backend whose o-projection delta, in graph mode
  only, adds a small extra term (a graph that replays a stale or wrong delta): E01 and E02 must fail in
  the graph modes, eager must pass.
- :func:`make_refusing_backend`: the reference backend answering ``Fallback`` in graph mode to every
  batch of more than one request although its graphs hold them (a backend that silently runs
  eagerly): E03 must fail, naming the step and the reason.
- :func:`make_cpu_less_backend`: the reference backend declaring no CPU device: every claim on the
  CPU is not implemented (the command exits 5).
"""

from __future__ import annotations

import dataclasses

from moelora_core.capabilities import Fallback


def _reference():
    from moelora_reference.backend import ReferenceBackend

    return ReferenceBackend


def make_graph_delta_backend(spec):
    class GraphDelta(_reference()):
        name = "graph-delta"

        def compute_dense_delta(self, module, x, out, weights, info):
            super().compute_dense_delta(module, x, out, weights, info)
            if info.use_cuda_graph and module == "o":
                out.add_(1e-2)

    return GraphDelta(spec)


def make_refusing_backend(spec):
    class Refusing(_reference()):
        name = "refusing"

        def prepare(self, batch, family=None, bucket=None):
            if family is not None and batch.bs > 1:
                return Fallback(f"{batch.bs} requests (test backend refuses more than one)")
            return super().prepare(batch, family, bucket)

    return Refusing(spec)


def make_cpu_less_backend(spec):
    class CpuLess(_reference()):
        name = "cpu-less"

        def capabilities(self):
            return dataclasses.replace(super().capabilities(), devices=frozenset({"cuda"}))

    return CpuLess(spec)
