"""No-op adapters and modules (``moelora_core.checkpoint.adapter_effect``).

Covers: lora_B exactly zero in every module (peft's default init) → a no-op adapter, named with the
hint; lora_A exactly zero; a delta below the dtype's tolerance row on the probe (fp32 1e-5; fp16 1e-3:
the same adapter is a no-op in fp16 and not in fp32); a visible delta's ``delta_rel`` equal to the
probe written out here (the 32 N(0, 1) rows of seed 0, ‖σ·B A X‖ / ‖W X‖); only some modules zero →
not a no-op, the modules listed; without base weights only the exact tests apply; a factor shared by
every expert (shared-outer) acts on each expert; the reader's config notes are carried into the
warnings.
"""

import math

import pytest
import torch

from moelora_core.checkpoint import MoEModelConfig, adapter_effect, read_adapter
from moelora_core.checkpoint.synthetic import adapter_tensors, model_config_dict, random_model, write_adapter

DIMS = dict(hidden=24, inter=16, experts=4, top_k=2, heads=2, kv_heads=1, head_dim=10)


def _cfg():
    return MoEModelConfig.from_dict(model_config_dict("qwen3_moe", **DIMS))


def _layer(cfg, gen, r=2, scale_b=1.0, shared_a=False):
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts  # noqa: E741
    a = torch.randn(1 if shared_a else E, r, H, generator=gen)
    return {"gate": (a, torch.randn(E, I, r, generator=gen) * scale_b),
            "up": (a.clone(), torch.randn(E, I, r, generator=gen) * scale_b),
            "down": (torch.randn(E, r, I, generator=gen),  # shared-outer: down's B is shared too
                     torch.randn(1 if shared_a else E, H, r, generator=gen) * scale_b),
            "q": (torch.randn(r, H, generator=gen), torch.randn(20, r, generator=gen) * scale_b)}


def _read(tmp_path, cfg, layers, name="ad", **config):
    tensors, targets = adapter_tensors(cfg, layers)
    path = write_adapter(tmp_path / name, tensors, {**targets, "r": 2, "lora_alpha": 4, **config})
    return read_adapter(path, cfg, name=name)


def test_zero_lora_b_everywhere_is_a_noop_adapter(tmp_path):
    cfg = _cfg()
    gen = torch.Generator().manual_seed(0)
    read = _read(tmp_path, cfg, {0: _layer(cfg, gen, scale_b=0.0), 1: _layer(cfg, gen, scale_b=0.0)})
    effect = adapter_effect(read, random_model(cfg).layers)
    assert effect.noop and len(effect.modules) == 8
    assert all(m.noop == "lora_B is exactly zero" and m.delta_rel is None for m in effect.modules)
    (warning,) = effect.warnings()
    assert "adapter 'ad' is a no-op: lora_B is exactly zero (8 of 8 modules)" in warning
    assert "init_lora_weights=True" in warning and "proves only the base model" in warning


def test_zero_lora_a_is_a_noop(tmp_path):
    cfg = _cfg()
    gen = torch.Generator().manual_seed(1)
    layer = {m: (torch.zeros_like(a), b) for m, (a, b) in _layer(cfg, gen).items()}
    effect = adapter_effect(_read(tmp_path, cfg, {0: layer}), None)
    assert effect.noop and {m.noop for m in effect.modules} == {"lora_A is exactly zero"}


def test_visible_delta_is_the_probe_written_out(tmp_path):
    cfg = _cfg()
    gen = torch.Generator().manual_seed(2)
    read = _read(tmp_path, cfg, {0: _layer(cfg, gen)})
    base = random_model(cfg).layers
    effect = adapter_effect(read, base)
    assert not effect.noop and not effect.warnings()
    x = torch.randn(32, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    q = read.layers[0]["q"]
    want = float((q.scaling * x @ q.lora_A.T @ q.lora_B.T).norm() / (x @ base[0].q_proj.T).norm())
    got = next(m.delta_rel for m in effect.modules if (m.layer, m.module) == (0, "q"))
    assert math.isclose(got, want, rel_tol=1e-5)
    up = read.layers[0]["up"]
    w_up = base[0].moe.w_gate_up[:, cfg.moe_intermediate_size:]
    want_up = float(torch.stack([up.scaling * x @ up.lora_A[e].T @ up.lora_B[e].T for e in range(4)]).norm()
                    / torch.stack([x @ w_up[e].T for e in range(4)]).norm())
    got_up = next(m.delta_rel for m in effect.modules if (m.layer, m.module) == (0, "up"))
    assert math.isclose(got_up, want_up, rel_tol=1e-5)


@pytest.mark.parametrize(("dtype", "noop"), [(torch.float32, False), (torch.float16, True)])
def test_delta_below_the_dtype_tolerance_is_a_noop(tmp_path, dtype, noop):
    # B scaled so every delta_rel lies between the fp32 row (1e-5) and the fp16 row (1e-3)
    cfg = _cfg()
    gen = torch.Generator().manual_seed(3)
    read = _read(tmp_path, cfg, {0: _layer(cfg, gen, scale_b=3e-5)})
    effect = adapter_effect(read, random_model(cfg).layers, dtype=dtype)
    rels = [m.delta_rel for m in effect.modules]
    assert all(1e-5 < r < 1e-3 for r in rels), rels
    assert effect.noop is noop
    if noop:
        assert "delta_rel below the fp16 tolerance 1e-03 on the probe (4 of 4 modules)" in effect.warnings()[0]
    # without base weights nothing is measured: only exact zeros make a no-op
    assert not adapter_effect(read, None, dtype=dtype).noop


def test_some_zero_modules_are_listed_not_a_noop_adapter(tmp_path):
    cfg = _cfg()
    gen = torch.Generator().manual_seed(4)
    layer = _layer(cfg, gen)
    layer["q"] = (layer["q"][0], torch.zeros_like(layer["q"][1]))
    effect = adapter_effect(_read(tmp_path, cfg, {0: layer, 1: _layer(cfg, gen)}), random_model(cfg).layers)
    assert not effect.noop
    assert [(m.layer, m.module) for m in effect.noop_modules()] == [(0, "q")]
    assert effect.warnings() == ("adapter 'ad': 1 of 8 modules add nothing (L0 q): lora_B is exactly zero",)


def test_shared_factor_acts_on_every_expert(tmp_path):
    cfg = _cfg()
    gen = torch.Generator().manual_seed(5)
    shared = _read(tmp_path, cfg, {0: _layer(cfg, gen, shared_a=True)}, name="shared")
    base = random_model(cfg).layers
    broadcast = shared.layers[0]["gate"]
    per_expert = broadcast.lora_A.expand(cfg.num_experts, -1, -1).clone()
    x = torch.randn(32, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    w = base[0].moe.w_gate_up[:, :cfg.moe_intermediate_size]
    want = float(torch.stack([broadcast.scaling * x @ per_expert[e].T @ broadcast.lora_B[e].T for e in range(4)]).norm()
                 / torch.stack([x @ w[e].T for e in range(4)]).norm())
    got = next(m.delta_rel for m in adapter_effect(shared, base).modules if m.module == "gate")
    assert math.isclose(got, want, rel_tol=1e-5)


def test_config_notes_become_warnings(tmp_path):
    cfg = _cfg()
    gen = torch.Generator().manual_seed(6)
    layer = {"q": _layer(cfg, gen)["q"]}
    tensors, _ = adapter_tensors(cfg, {0: layer})
    path = write_adapter(tmp_path / "w", tensors, {"target_modules": ["q_proj", "w1", "w3"], "r": 2, "lora_alpha": 4})
    effect = adapter_effect(read_adapter(path, cfg, name="w"), None)
    (warning,) = effect.warnings()
    assert warning.startswith("adapter 'w': target_modules ['w1', 'w3'] name another model family's expert")
