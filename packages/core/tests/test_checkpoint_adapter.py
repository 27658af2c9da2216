"""PEFT adapter reader (moelora_core.checkpoint.read_adapter) on synthetic PEFT-format files.

Covers: the fused target_parameters layout (lora_A expert-major, lora_B rank-major expert-minor,
stated element by element here), gate/up split of the fused B with one shared A, ParamWrapper
nesting (both targeted / one targeted / config order), legacy per-expert keys (gate_A != up_A,
Mixtral w1/w3/w2, absent modules and experts), dense q/k/v/o, rank_pattern / alpha_pattern on
the paths PEFT matches, rsLoRA with the module's own r, stored fp16/bf16 cast to the compute dtype,
per-expert ranks, and the delta against PEFT's ``get_delta_weight`` formula typed out.
"""

import math

import pytest
import torch

from moelora_core.checkpoint import AdapterFormatError, MoEModelConfig, NonFiniteWeightError, read_adapter
from moelora_core.checkpoint.synthetic import adapter_tensors, model_config_dict, write_adapter

DIMS = dict(hidden=24, inter=16, experts=4, top_k=2, heads=2, kv_heads=1, head_dim=10)


def _cfg(family="qwen3_moe", **over):
    return MoEModelConfig.from_dict(model_config_dict(family, **{**DIMS, **over}))


def _factors(cfg, modules, r, gen, *, shared_gate_up=True):
    """Random moelora-layout factors for one layer."""
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts  # noqa: E741
    out = {}
    for m in modules:
        if m in ("gate", "up", "down"):
            fin, fout = (I, H) if m == "down" else (H, I)
            out[m] = (torch.randn(E, r, fin, generator=gen), torch.randn(E, fout, r, generator=gen))
        else:
            fin, fout = cfg.dense_shapes[m]
            out[m] = (torch.randn(r, fin, generator=gen), torch.randn(fout, r, generator=gen))
    if shared_gate_up and "gate" in out and "up" in out:
        out["up"] = (out["gate"][0].clone(), out["up"][1])
    return out


def _write(tmp_path, cfg, layers, fmt="fused", dtype=None, **config):
    tensors, targets = adapter_tensors(cfg, layers, expert_format=fmt)
    conf = {**targets, **config}
    if not conf["target_parameters"]:
        conf["target_parameters"] = None
    return write_adapter(tmp_path / "ad", tensors, conf, dtype=dtype), tensors


def _assert_factors(read_layer, want, sigma):
    assert set(read_layer) == set(want)
    for m, (A, B) in want.items():
        got = read_layer[m]
        assert torch.equal(got.lora_A, A), m
        assert torch.equal(got.lora_B, B), m
        assert got.rank == A.shape[-2]
        assert math.isclose(got.scaling, sigma), (m, got.scaling, sigma)


def test_fused_layout_element_by_element(tmp_path):
    cfg = _cfg()
    gen = torch.Generator().manual_seed(0)
    want = _factors(cfg, ("gate", "up", "down", "q", "k", "v", "o"), 3, gen)
    path, tensors = _write(tmp_path, cfg, {0: want, 1: want}, r=3, lora_alpha=6)
    # The file layout, stated directly: A row e·r + j is expert e's row j; B column j·E + e is
    # expert e's column j; gate_up B stacks gate rows [:I] over up rows [I:].
    E, I = 4, 16  # noqa: E741
    a_file = tensors["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"]
    b_file = tensors["base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight"]
    assert a_file.shape == (E * 3, 24) and b_file.shape == (2 * I, 3 * E)
    assert torch.equal(a_file[2 * 3 + 1], want["gate"][0][2, 1])
    assert torch.equal(b_file[:I, 1 * E + 2], want["gate"][1][2, :, 1])
    assert torch.equal(b_file[I:, 0 * E + 3], want["up"][1][3, :, 0])
    read = read_adapter(path, cfg)
    assert read.formats == ("fused",) and read.stored_dtypes == ("float32",)
    for layer in read.layers:
        _assert_factors(layer, want, 2.0)


def test_fused_delta_matches_peft_get_delta_weight_formula(tmp_path):
    # peft's ParamWrapper.get_delta_weight for [E, out, in] parameters, typed out:
    #   A = lora_A.reshape(E, r, in); B = lora_B.reshape(out, r, E)
    #   delta = einsum("o r e, e r i -> e o i", B, A) * scaling
    cfg = _cfg()
    gen = torch.Generator().manual_seed(1)
    want = _factors(cfg, ("down",), 5, gen)
    path, tensors = _write(tmp_path, cfg, {0: want}, r=5, lora_alpha=10)
    a = tensors["base_model.model.model.layers.0.mlp.experts.lora_A.weight"].double()
    b = tensors["base_model.model.model.layers.0.mlp.experts.lora_B.weight"].double()
    peft_delta = torch.einsum("ore,eri->eoi", b.reshape(b.shape[0], 5, 4), a.reshape(4, 5, a.shape[1])) * 2.0
    got = read_adapter(path, cfg).layers[0]["down"]
    ours = got.scaling * torch.einsum("eor,eri->eoi", got.lora_B.double(), got.lora_A.double())
    torch.testing.assert_close(ours, peft_delta, rtol=0, atol=1e-12)


@pytest.mark.parametrize("order", [["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                                   ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]])
def test_nesting_does_not_depend_on_config_order(tmp_path, order):
    cfg = _cfg()
    want = _factors(cfg, ("gate", "up", "down"), 2, torch.Generator().manual_seed(2))
    path, _ = _write(tmp_path, cfg, {1: want}, r=2, lora_alpha=2, target_parameters=order)
    read = read_adapter(path, cfg)
    assert read.layers[0] == {}
    _assert_factors(read.layers[1], want, 1.0)


@pytest.mark.parametrize("modules", [("gate", "up"), ("down",)], ids=["gate_up_only", "down_only"])
def test_one_targeted_parameter_is_bare_experts(tmp_path, modules):
    # With H = 2I, down's A [E·r, I] and gate_up's A [E·r, H] still differ, but B [H, r·E] and
    # [2I, r·E] do not: the reader follows target_parameters, not shapes.
    cfg = _cfg(hidden=32, inter=16, head_dim=16)
    want = _factors(cfg, modules, 2, torch.Generator().manual_seed(3))
    path, tensors = _write(tmp_path, cfg, {0: want}, r=2, lora_alpha=4)
    assert not any("base_layer" in k for k in tensors)
    _assert_factors(read_adapter(path, cfg).layers[0], want, 2.0)


def test_nested_keys_without_both_targets_are_refused(tmp_path):
    cfg = _cfg()
    want = _factors(cfg, ("gate", "up", "down"), 2, torch.Generator().manual_seed(4))
    path, _ = _write(tmp_path, cfg, {0: want}, r=2, lora_alpha=2, target_parameters=["mlp.experts.down_proj"])
    with pytest.raises(AdapterFormatError, match=r"need both gate_up_proj and down_proj targeted"):
        read_adapter(path, cfg)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_legacy_per_expert_keeps_gate_and_up_apart(tmp_path, family):
    cfg = _cfg(family)
    gen = torch.Generator().manual_seed(5)
    want = _factors(cfg, ("gate", "up", "down", "q"), 4, gen, shared_gate_up=False)
    assert not torch.equal(want["gate"][0], want["up"][0])  # gate_A != up_A
    path, tensors = _write(tmp_path, cfg, {0: want, 1: want}, fmt="per_expert", r=4, lora_alpha=8)
    leaf = "w3" if family == "mixtral" else "up_proj"
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    assert f"base_model.model.model.layers.0.{block}.experts.2.{leaf}.lora_A.weight" in tensors
    read = read_adapter(path, cfg)
    assert read.formats == ("per_expert",)
    _assert_factors(read.layers[1], want, 2.0)


def test_legacy_absent_module_and_expert_are_zero(tmp_path):
    cfg = _cfg()
    want = _factors(cfg, ("gate", "down"), 2, torch.Generator().manual_seed(6))  # no "up"
    tensors, targets = adapter_tensors(cfg, {0: want}, expert_format="per_expert")
    for key in [k for k in tensors if ".experts.1." in k and "down_proj" in k]:
        del tensors[key]  # expert 1 has no down factors
    path = write_adapter(tmp_path / "ad", tensors, {**targets, "r": 2, "lora_alpha": 2})
    layer = read_adapter(path, cfg).layers[0]
    assert set(layer) == {"gate", "down"}
    assert torch.equal(layer["gate"].lora_A, want["gate"][0])
    assert not layer["down"].lora_A[1].any() and not layer["down"].lora_B[1].any()
    assert torch.equal(layer["down"].lora_B[3], want["down"][1][3])


def test_patterns_follow_peft_paths(tmp_path):
    # PEFT matches target_parameters patterns against the parameter path
    # (model.layers.L.mlp.experts.gate_up_proj), so "mlp.experts" matches nothing and gate_up /
    # down take separate patterns; dense modules match their module path.
    cfg = _cfg()
    gen = torch.Generator().manual_seed(7)
    layer0 = {**_factors(cfg, ("gate", "up"), 2, gen), **_factors(cfg, ("down",), 3, gen),
              **_factors(cfg, ("q",), 5, gen), **_factors(cfg, ("v",), 4, gen)}
    layer1 = {**_factors(cfg, ("gate", "up"), 2, gen), **_factors(cfg, ("down",), 6, gen),
              **_factors(cfg, ("q",), 5, gen), **_factors(cfg, ("v",), 4, gen)}
    # The first matching key in the file's order wins (peft writes the config with sorted keys):
    # "layers.1.mlp.experts.down_proj" sorts before "mlp.experts.down_proj".
    path, _ = _write(tmp_path, cfg, {0: layer0, 1: layer1}, r=4, lora_alpha=8,
                     rank_pattern={"mlp.experts": 7, "gate_up_proj": 2, "layers.1.mlp.experts.down_proj": 6,
                                   "mlp.experts.down_proj": 3, "q_proj": 5},
                     alpha_pattern={"down_proj": 9, "layers.0.self_attn.v_proj": 1})
    read = read_adapter(path, cfg)
    got = {li: {m: (lo.rank, lo.scaling) for m, lo in layer.items()} for li, layer in enumerate(read.layers)}
    assert got[0] == {"gate": (2, 4.0), "up": (2, 4.0), "down": (3, 3.0), "q": (5, 8 / 5), "v": (4, 0.25)}
    assert got[1] == {"gate": (2, 4.0), "up": (2, 4.0), "down": (6, 1.5), "q": (5, 8 / 5), "v": (4, 2.0)}


def test_pattern_order_is_the_files(tmp_path):
    # A generic key that comes first in the file shadows a more specific one, as in peft.
    cfg = _cfg()
    gen = torch.Generator().manual_seed(13)
    path, _ = _write(tmp_path, cfg, {0: _factors(cfg, ("down",), 3, gen), 1: _factors(cfg, ("down",), 3, gen)},
                     r=4, lora_alpha=6, rank_pattern={"down_proj": 3, "layers.1.mlp.experts.down_proj": 6})
    assert [layer["down"].rank for layer in read_adapter(path, cfg).layers] == [3, 3]


@pytest.mark.parametrize("fmt", ["fused", "per_expert"])
def test_rslora_uses_the_module_rank(tmp_path, fmt):
    cfg = _cfg()
    want = _factors(cfg, ("gate", "up", "down"), 4, torch.Generator().manual_seed(8), shared_gate_up=fmt == "fused")
    path, _ = _write(tmp_path, cfg, {0: want}, fmt=fmt, r=4, lora_alpha=8, use_rslora=True)
    for lora in read_adapter(path, cfg).layers[0].values():
        assert lora.scaling == 8 / math.sqrt(4)  # α/√r with the file's r; never peft's 2α/√(2r) for legacy


@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16])
def test_low_precision_storage_is_cast_to_compute_dtype(tmp_path, stored):
    cfg = _cfg()
    want = _factors(cfg, ("gate", "up", "down", "k"), 2, torch.Generator().manual_seed(9))
    path, _ = _write(tmp_path, cfg, {0: want}, dtype=stored, r=2, lora_alpha=2)
    read = read_adapter(path, cfg, dtype=torch.float32)
    assert read.stored_dtypes == (str(stored).removeprefix("torch."),)
    for m, (A, B) in want.items():
        assert read.layers[0][m].lora_A.dtype == torch.float32
        assert torch.equal(read.layers[0][m].lora_A, A.to(stored).float())
        assert torch.equal(read.layers[0][m].lora_B, B.to(stored).float())
    half = read_adapter(path, cfg, dtype=torch.float16)
    assert half.layers[0]["k"].lora_B.dtype == torch.float16


def test_overflow_on_cast_is_refused(tmp_path):
    cfg = _cfg()
    want = _factors(cfg, ("o",), 2, torch.Generator().manual_seed(10))
    want["o"][1][0, 0] = 1e6  # finite in fp32, Inf in fp16
    path, _ = _write(tmp_path, cfg, {0: want}, r=2, lora_alpha=2)
    read_adapter(path, cfg)  # fp32 is fine
    with pytest.raises(NonFiniteWeightError, match=r"o_proj\.lora_B\.weight: overflows float16 when cast from float32"):
        read_adapter(path, cfg, dtype=torch.float16)


def test_per_expert_ranks_pad_when_sigma_agrees(tmp_path):
    cfg = _cfg()
    gen = torch.Generator().manual_seed(11)
    want = _factors(cfg, ("gate",), 4, gen, shared_gate_up=False)
    tensors, targets = adapter_tensors(cfg, {0: want}, expert_format="per_expert")
    key = "base_model.model.model.layers.0.mlp.experts.2.gate_proj"
    tensors[f"{key}.lora_A.weight"] = tensors[f"{key}.lora_A.weight"][:2]
    tensors[f"{key}.lora_B.weight"] = tensors[f"{key}.lora_B.weight"][:, :2]
    conf = {**targets, "r": 4, "lora_alpha": 8, "rank_pattern": {"experts.2.gate_proj": 2},
            "alpha_pattern": {"experts.2.gate_proj": 4}}  # σ = 2 everywhere
    gate = read_adapter(write_adapter(tmp_path / "a", tensors, conf), cfg).layers[0]["gate"]
    assert gate.rank == 4 and gate.scaling == 2.0
    assert torch.equal(gate.lora_A[2, :2], want["gate"][0][2, :2]) and not gate.lora_A[2, 2:].any()
    assert not gate.lora_B[2, :, 2:].any()
    conf["alpha_pattern"] = {}
    with pytest.raises(AdapterFormatError, match=r"σ differs between experts of one module"):
        read_adapter(write_adapter(tmp_path / "b", tensors, conf), cfg)


def test_adapter_level_summary(tmp_path):
    cfg = _cfg()
    want = _factors(cfg, ("up", "gate", "v"), 3, torch.Generator().manual_seed(12))
    path, _ = _write(tmp_path, cfg, {1: want}, r=3, lora_alpha=6, rank_pattern={"v_proj": 3})
    read = read_adapter(path, cfg, name="my-adapter")
    assert read.name == "my-adapter" and read.num_layers == 2
    assert read.modules() == ("gate", "up", "v") and read.max_rank() == 3 and read.scaling() == 2.0
