"""Shared-outer and fully shared expert adapters in both encodings (moelora_core.checkpoint).

Covers: the 3-D encoding (``experts.gate_up_proj.lora_A.weight`` [E_A, r, H], ...) and PEFT's 2-D
fused encoding (A [E_A·r, in], B [out, r·E_B]) with expert count 1 on the shared side, read back
factor for factor against the tensors written (a shared factor stays ``[1, ...]``), the layout
detected from the expert counts (a fully shared 2-D file is not taken for another model's expert
count); the named refusals (``ExpertLayoutError``): a shared factor on one layer only, two
encodings in one file, the shared side on the wrong factor (gate_up B / down A); loading into pools
of each layout (stored once per slot; broadcast into a per-expert pool; a per-expert adapter into a
shared pool refused with no slot changed).
"""

from dataclasses import replace

import pytest
import torch

from moelora_core import EXPERT_FACTORS, LoRAWeights
from moelora_core.checkpoint import ExpertLayoutError, MoEModelConfig, read_adapter
from moelora_core.checkpoint.slot_loader import load_adapter_into_slot
from moelora_core.checkpoint.synthetic import adapter_tensors, model_config_dict, write_adapter
from moelora_core.layer_spec import EXPERT_LAYOUTS, expert_factor

DIMS = dict(hidden=24, inter=16, experts=4, top_k=2, heads=2, kv_heads=1, head_dim=10)
ENCODINGS = ("fused", "packed")
LAYOUTS = ("per_expert", "shared_outer", "fully_shared")
R = 3


def _cfg(**over):
    return MoEModelConfig.from_dict(model_config_dict("qwen3_moe", **{**DIMS, **over}))


def _layer(cfg, layout, gen, r=R, modules=("gate", "up", "down", "q")):
    """moelora-layout factors of one layer in ``layout``: a shared factor drawn once, [1, ...]."""
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts  # noqa: E741
    shared = EXPERT_LAYOUTS[layout]
    out = {}
    for m in modules:
        if m in ("gate", "up", "down"):
            fin, fout = (I, H) if m == "down" else (H, I)
            ea = 1 if expert_factor(m, "A") in shared else E
            eb = 1 if expert_factor(m, "B") in shared else E
            out[m] = (torch.randn(ea, r, fin, generator=gen), torch.randn(eb, fout, r, generator=gen))
        else:
            fin, fout = cfg.dense_shapes[m]
            out[m] = (torch.randn(r, fin, generator=gen), torch.randn(fout, r, generator=gen))
    if "gate" in out and "up" in out:
        out["up"] = (out["gate"][0].clone(), out["up"][1])
    return out


def _write(path, cfg, layers, encoding):
    tensors, targets = adapter_tensors(cfg, layers, expert_format=encoding)
    conf = {**targets, "r": R, "lora_alpha": 2 * R}
    return write_adapter(path, tensors, conf), tensors


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_read_back_factor_for_factor(tmp_path, encoding, layout):
    cfg = _cfg()
    gen = torch.Generator().manual_seed(1)
    layers = {0: _layer(cfg, layout, gen), 1: _layer(cfg, layout, gen)}
    path, tensors = _write(tmp_path / "ad", cfg, layers, encoding)
    if encoding == "packed":  # the 3-D keys, as SGLang / Megatron-Bridge name them
        A = tensors["base_model.model.model.layers.0.mlp.experts.gate_up_proj.lora_A.weight"]
        assert A.shape == (1 if layout != "per_expert" else 4, R, cfg.hidden_size)
    read = read_adapter(path, cfg)
    assert read.expert_layout == layout
    assert read.formats == (encoding,)
    for li, want in layers.items():
        for m, (A, B) in want.items():
            got = read.layers[li][m]
            assert torch.equal(got.lora_A, A), (li, m)
            assert torch.equal(got.lora_B, B), (li, m)
            assert got.scaling == 2.0


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_fully_shared_fused_file_is_not_another_models_expert_count(tmp_path, encoding):
    # every 2-D fused A holds r rows: an expert count of 1 (shared), not a 1-expert model
    cfg = _cfg()
    layers = {0: _layer(cfg, "fully_shared", torch.Generator().manual_seed(2), modules=("gate", "up", "down"))}
    path, _ = _write(tmp_path / "ad", cfg, layers, encoding)
    assert read_adapter(path, cfg).expert_layout == "fully_shared"


def test_layout_comes_from_expert_counts_not_sizes(tmp_path):
    # H = E·r: a shared-outer 2-D gate_up A [r, H] next to per-expert down A [E·r, I]; the sizes
    # alone fit several readings, the config's rank and the counts decide
    cfg = _cfg(hidden=12, inter=12)
    layers = {0: _layer(cfg, "shared_outer", torch.Generator().manual_seed(3), modules=("gate", "up", "down"))}
    path, _ = _write(tmp_path / "ad", cfg, layers, "fused")
    read = read_adapter(path, cfg)
    assert read.expert_layout == "shared_outer"
    assert read.layers[0]["gate"].lora_A.shape == (1, R, 12)
    assert read.layers[0]["down"].lora_A.shape == (4, R, 12)


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_shared_factor_on_one_layer_only_is_refused(tmp_path, encoding):
    cfg = _cfg()
    gen = torch.Generator().manual_seed(4)
    layers = {0: _layer(cfg, "shared_outer", gen), 1: _layer(cfg, "per_expert", gen)}
    path, _ = _write(tmp_path / "ad", cfg, layers, encoding)
    with pytest.raises(ExpertLayoutError, match="do not share one layout") as info:
        read_adapter(path, cfg)
    assert "layer 1" in str(info.value) and "shared_outer" in str(info.value)


def test_two_encodings_in_one_file_are_refused(tmp_path):
    cfg = _cfg()
    gen = torch.Generator().manual_seed(5)
    packed, targets = adapter_tensors(cfg, {0: _layer(cfg, "shared_outer", gen)}, expert_format="packed")
    fused, _ = adapter_tensors(cfg, {1: _layer(cfg, "shared_outer", gen)}, expert_format="fused")
    path = write_adapter(tmp_path / "ad", {**packed, **fused}, {**targets, "r": R, "lora_alpha": R})
    with pytest.raises(ExpertLayoutError, match="mixes two encodings"):
        read_adapter(path, cfg)


@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("stage", ["gate_up", "down"])
def test_shared_side_on_the_wrong_factor_is_refused(tmp_path, encoding, stage):
    cfg = _cfg()
    layers = {0: _layer(cfg, "per_expert", torch.Generator().manual_seed(6), modules=("gate", "up", "down"))}
    mods = ("gate", "up") if stage == "gate_up" else ("down",)
    for m in mods:  # gate_up B / down A shared, their partners per expert
        A, B = layers[0][m]
        layers[0][m] = (A, B[:1].clone()) if stage == "gate_up" else (A[:1].clone(), B)
    path, _ = _write(tmp_path / "ad", cfg, layers, encoding)
    with pytest.raises(ExpertLayoutError, match="wrong factor"):
        read_adapter(path, cfg)


def _pools(cfg, layout, L=2):
    spec = cfg.layer_spec(max_loras=L, max_rank=4)
    return [LoRAWeights(replace(spec, expert_layout=layout)) for _ in range(cfg.num_layers)]


@pytest.mark.parametrize("pool_layout", LAYOUTS)
def test_shared_outer_adapter_loads_into_every_pool_layout_it_fits(tmp_path, pool_layout):
    cfg = _cfg()
    gen = torch.Generator().manual_seed(7)
    layers = {0: _layer(cfg, "shared_outer", gen), 1: _layer(cfg, "shared_outer", gen)}
    read = read_adapter(_write(tmp_path / "ad", cfg, layers, "packed")[0], cfg)
    pools = _pools(cfg, pool_layout)
    if pool_layout == "fully_shared":  # gate_up B / down A are per expert: no single copy to keep
        before = [{f: p.storage(f).clone() for f in EXPERT_FACTORS} for p in pools]
        with pytest.raises(ExpertLayoutError, match="once per slot"):
            load_adapter_into_slot(pools, 1, read)
        for p, b in zip(pools, before):
            assert all(torch.equal(p.storage(f), b[f]) for f in EXPERT_FACTORS)
        return
    load_adapter_into_slot(pools, 1, read)
    E = cfg.num_experts
    for li, p in enumerate(pools):
        for e in range(E):  # every expert reads the file's one shared A / B
            assert torch.equal(p.gate_A[1, e, :R], layers[li]["gate"][0][0])
            assert torch.equal(p.down_B[1, e, :, :R], layers[li]["down"][1][0])
            assert torch.equal(p.down_A[1, e, :R], layers[li]["down"][0][e])
        if pool_layout == "shared_outer":
            assert p.storage("gate_up_A").shape[2] == 1 and p.storage("down_B").shape[1] == 1
