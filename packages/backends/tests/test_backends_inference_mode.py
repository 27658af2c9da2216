"""Every built-in backend under ``torch.inference_mode()``, the way serving engines run the forward.

Regression: the kernel backends' delta calls read ``topk_ids._version``
(inference tensors have no version counter), and the static and staging buffers of all three
backends became inference tensors when ``init_*_graph`` or the first ``prepare`` ran inside
``inference_mode``, so any later ``prepare`` outside it failed ("Inplace update to inference
tensor outside InferenceMode").

Covers, for ``reference``, ``triton`` and ``csgmv``: graph-family init and a first (staging-growing)
eager ``prepare``, then eager / decode / prefill ``prepare`` with the MoE and dense deltas, with
each of the two phases inside or outside ``inference_mode`` — every order gives bit for bit the
outputs of a run that never enters it.
"""

import pytest
import torch

from moelora_core import BatchSpec, ForwardMode, LoRALayerSpec, LoRAWeights, ModuleLoRA, Request, load_backend
from moelora_core.backend_checks import GraphCapacity

pytestmark = pytest.mark.interpreter
H, I, E, K, L, R = 16, 16, 4, 2, 3, 8  # noqa: E741
NAMES = ("reference", "triton", "csgmv")


def _weights():
    spec = LoRALayerSpec(hidden_size=H, moe_intermediate_size=I, num_experts=E, top_k=K, dense_shapes={"q": (H, 12)},
                         max_loras=L, max_rank=R)
    gen = torch.Generator().manual_seed(3)
    weights = LoRAWeights(spec)
    rnd = lambda *shape: torch.randn(*shape, generator=gen) / shape[-1] ** 0.5
    for slot, r, sigma in ((0, 8, 0.5), (2, 4, 2.0)):
        adapter = {m: ModuleLoRA(rnd(E, r, fin), rnd(E, fout, r), sigma)
                   for m, (fin, fout) in (("gate", (H, I)), ("up", (H, I)), ("down", (I, H)))}
        adapter["q"] = ModuleLoRA(rnd(r, H), rnd(12, r), sigma)
        weights.load_slot(slot, adapter)
    return spec, weights


def _batches(weights):
    ranks, scalings = weights.slot_ranks(), weights.slot_scalings()
    extend = BatchSpec(ForwardMode.EXTEND, [Request(0, 5), Request(-1, 2), Request(2, 3)], L, ranks, scalings)
    decode = BatchSpec(ForwardMode.DECODE, [Request(2, 1), Request(0, 1), Request(-1, 1)], L, ranks, scalings)
    return extend, decode


def _mode(inside: bool):
    return torch.inference_mode() if inside else torch.inference_mode(False)


def _deltas(backend, weights, info, seed):
    """The three delta calls on fresh random inputs of the info's token rows; their outputs."""
    T = info.token_lora_mapping.numel()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    ids = torch.randint(0, E, (T, K), generator=gen, dtype=torch.int32)
    tw = torch.rand(T, K, generator=gen)
    gate_up = torch.randn(T, K, 2 * I, generator=gen)
    down = torch.randn(T, K, H, generator=gen)
    h = torch.randn(T * K, I, generator=gen)
    q = torch.randn(T, 12, generator=gen)
    backend.moe_gate_up_delta(x, ids, gate_up, weights, info)
    backend.moe_down_delta(h, ids, tw, down, weights, info)
    backend.dense_delta("q", x, q, weights, info)
    return gate_up, down, q


def _session(name, init_inside: bool, serve_inside: bool):
    spec, weights = _weights()
    backend = load_backend(name)(spec)
    extend, decode = _batches(weights)
    with _mode(init_inside):
        backend.init_graph("decode", GraphCapacity.decode(4, 1))
        backend.init_graph("prefill", GraphCapacity.prefill(16, 4))
        backend.prepare(extend)  # the first eager prepare grows the staging buffers
    outputs = []
    with _mode(serve_inside):
        for n, (batch, family) in enumerate(((extend, None), (decode, "decode"), (extend, "prefill"), (decode, None))):
            outputs += _deltas(backend, weights, backend.prepare(batch, family), seed=n)
    return outputs


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("init_inside", "serve_inside"), [(True, True), (True, False), (False, True)],
                         ids=["all-inside", "init-inside-serve-outside", "init-outside-serve-inside"])
def test_inference_mode_in_any_phase_gives_the_outputs_of_a_normal_run(name, init_inside, serve_inside):
    got = _session(name, init_inside, serve_inside)
    want = _session(name, False, False)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"{name}: output {i} differs from the run outside inference_mode"
