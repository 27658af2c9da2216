"""The reference backend under ``torch.inference_mode()``, the way serving engines run the forward.

Regression: static and staging buffers allocated by ``init_*_graph`` or
the first eager ``prepare`` inside ``inference_mode`` were inference tensors, and every later
``prepare`` outside it failed ("Inplace update to inference tensor outside InferenceMode").

Covers: graph-family init plus a first (staging-growing) eager ``prepare``, then eager / decode /
prefill ``prepare`` and the layer harness plus a dense delta, with each of the two phases inside or
outside ``inference_mode``: every order gives bit for bit the outputs of a run that never enters it,
and the static buffers stay normal tensors. (``packages/backends/tests`` runs the same scenario over
the kernel backends.)
"""

from types import SimpleNamespace

import pytest
import torch

from moelora_core import BatchSpec, ForwardMode, LoRALayerSpec, LoRAWeights, ModuleLoRA, MoEBaseWeights, Request
from moelora_core.backend_checks import GraphCapacity
from moelora_reference.backend import make_backend

H, I, E, K, L, R = 16, 16, 4, 2, 3, 8  # noqa: E741


def _layer():
    spec = LoRALayerSpec(hidden_size=H, moe_intermediate_size=I, num_experts=E, top_k=K, dense_shapes={"q": (H, 12)},
                         max_loras=L, max_rank=R)
    gen = torch.Generator().manual_seed(7)
    rnd = lambda *shape: torch.randn(*shape, generator=gen) / shape[-1] ** 0.5
    weights = LoRAWeights(spec)
    for slot, r, sigma in ((0, 8, 0.5), (2, 4, 2.0)):
        adapter = {m: ModuleLoRA(rnd(E, r, fin), rnd(E, fout, r), sigma)
                   for m, (fin, fout) in (("gate", (H, I)), ("up", (H, I)), ("down", (I, H)))}
        adapter["q"] = ModuleLoRA(rnd(r, H), rnd(12, r), sigma)
        weights.load_slot(slot, adapter)
    base = MoEBaseWeights(w_gate_up=rnd(E, 2 * I, H), w_down=rnd(E, H, I), router=rnd(E, H))
    return spec, weights, base


def _session(init_inside: bool, serve_inside: bool, run_layer):
    spec, weights, base = _layer()
    backend = make_backend(spec)
    ranks, scalings = weights.slot_ranks(), weights.slot_scalings()
    extend = BatchSpec(ForwardMode.EXTEND, [Request(0, 5), Request(-1, 2), Request(2, 3)], L, ranks, scalings)
    decode = BatchSpec(ForwardMode.DECODE, [Request(2, 1), Request(0, 1), Request(-1, 1)], L, ranks, scalings)
    with torch.inference_mode(init_inside):
        backend.init_graph("decode", GraphCapacity.decode(4, 1))
        backend.init_graph("prefill", GraphCapacity.prefill(16, 4))
        backend.prepare(extend)  # the first eager prepare grows the staging buffers
    outputs = []
    with torch.inference_mode(serve_inside):
        for n, (batch, family) in enumerate(((extend, None), (decode, "decode"), (extend, "prefill"), (decode, None))):
            info = backend.prepare(batch, family)
            T = info.token_lora_mapping.numel()
            gen = torch.Generator().manual_seed(n)
            x = torch.randn(T, H, generator=gen)
            ids = torch.randint(0, E, (T, K), generator=gen, dtype=torch.int32)
            tw = torch.rand(T, K, generator=gen)
            q = torch.randn(T, 12, generator=gen)
            outputs.append(run_layer(backend, SimpleNamespace(base=base, lora=weights), info, x, ids, tw))
            backend.dense_delta("q", x, q, weights, info)
            outputs.append(q)
    for family in ("decode", "prefill"):
        assert not any(t.is_inference() for t in backend.static_buffers(family).values())
    return outputs


@pytest.mark.parametrize(("init_inside", "serve_inside"), [(True, True), (True, False), (False, True)],
                         ids=["all-inside", "init-inside-serve-outside", "init-outside-serve-inside"])
def test_inference_mode_in_any_phase_gives_the_outputs_of_a_normal_run(init_inside, serve_inside, layer):
    got = _session(init_inside, serve_inside, layer)
    want = _session(False, False, layer)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"output {i} differs from the run outside inference_mode"
