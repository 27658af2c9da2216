"""GPT-OSS's MoE block: the oracle and the torch base path against transformers + PEFT (DESIGN.md §1).

One tiny ``GptOssForCausalLM`` layer built from a config (random weights, nothing downloaded), its
``GptOssMLP`` (router with bias, experts with biases, interleaved gate/up, clamped SwiGLU) run by
transformers 5.17, with and without a PEFT ``target_parameters`` adapter on
``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``; moelora's side reads the module's tensors
through ``moelora_core.checkpoint.gpt_oss`` (de-interleaving, PEFT's expert-major A and rank-major
B). fp32, DEFAULT_POLICY (1e-5), topk_ids exact.

Named cases: inputs scaled so the clamp at ``limit`` binds for some gate and up values (a path
without the clamp, or with plain SiLU, fails ``test_the_clamp_binds``); the expert biases count with
the delta (dropping the gate/up bias fails ``test_the_expert_biases_count``); an adapter whose B is
read without de-interleaving (B's rows split in halves) fails ``test_reading_b_halves_fails``.
"""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from moelora_core.base_weights import MoEBaseWeights  # noqa: E402
from moelora_core.checkpoint.gpt_oss import gpt_oss_experts, gpt_oss_lora_factors, split_gate_up_lora  # noqa: E402
from moelora_core.layer_spec import LoRALayerSpec  # noqa: E402
from moelora_core.moe_activation import SILU, SWIGLU_OAI  # noqa: E402
from moelora_core.tolerance import DEFAULT_POLICY, assert_exact  # noqa: E402
from moelora_core.weights import LoRAWeights, ModuleLoRA  # noqa: E402
from moelora_reference import base_moe, oracle  # noqa: E402

H, I, E, K, T, R, ALPHA = 32, 24, 4, 2, 12, 4, 8  # noqa: E741 (I: the expert width, as in DESIGN.md)
F32 = torch.float32


def _model(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.GptOssConfig(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=I,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=E,
        num_experts_per_tok=K,
        sliding_window=4,
        max_position_embeddings=64,
        dtype="float32",
    )
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # every tensor random and visible (biases start at zero)
            p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(seed + p.numel()))
    return model


def _peft(model):
    cfg = peft.LoraConfig(
        r=R,
        lora_alpha=ALPHA,
        target_modules=[],
        init_lora_weights=False,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    wrapped = peft.get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.4, generator=torch.Generator().manual_seed(p.numel()))
    return wrapped


def _experts_tensors(mlp):
    ex = mlp.experts
    while hasattr(ex, "base_layer"):  # peft's ParamWrappers nest: down_proj's wraps gate_up_proj's
        ex = ex.base_layer
    return ex


def _base(mlp) -> MoEBaseWeights:
    ex = _experts_tensors(mlp)
    w_gu, b_gu, w_d, b_d = gpt_oss_experts(
        ex.gate_up_proj.detach(), ex.gate_up_proj_bias.detach(), ex.down_proj.detach(), ex.down_proj_bias.detach()
    )
    return MoEBaseWeights(
        w_gate_up=w_gu,
        w_down=w_d,
        router=mlp.router.weight.detach(),
        b_gate_up=b_gu,
        b_down=b_d,
        router_bias=mlp.router.bias.detach(),
        activation=SWIGLU_OAI,
    )


def _wrappers(mlp):
    """{parameter name: peft ParamWrapper} of the experts module."""
    out, m = {}, mlp.experts
    while hasattr(m, "parameter_name"):
        out[m.parameter_name] = m
        m = m.base_layer
    return out


def _pool(mlp, *, halves_b: bool = False) -> LoRAWeights:
    spec = LoRALayerSpec(
        hidden_size=H,
        moe_intermediate_size=I,
        num_experts=E,
        top_k=K,
        dense_shapes={},
        max_loras=2,
        max_rank=R + 2,
        dtype=F32,
        device=torch.device("cpu"),
    )
    pool = LoRAWeights(spec)
    wr = _wrappers(mlp)
    gu, dn = wr["gate_up_proj"], wr["down_proj"]
    a, b = gpt_oss_lora_factors(gu.lora_A["default"].weight.detach(), gu.lora_B["default"].weight.detach(), E)
    sigma = gu.scaling["default"]
    if halves_b:  # the fault: B's out axis read as gate rows first
        parts = {"gate": (a, b[:, :I]), "up": (a, b[:, I:])}
    else:
        parts = split_gate_up_lora(a, b)
    adapter = {m: ModuleLoRA(A, B, sigma) for m, (A, B) in parts.items()}
    da, db = gpt_oss_lora_factors(dn.lora_A["default"].weight.detach(), dn.lora_B["default"].weight.detach(), E)
    adapter["down"] = ModuleLoRA(da, db, dn.scaling["default"])
    pool.load_slot(1, adapter)
    return pool


def _route(base: MoEBaseWeights, x):
    logits = x.double() @ base.router.double().T + base.router_bias.double()
    return oracle.route_topk(logits, K, True)


def _inputs(scale: float = 3.0):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(7)) * scale


def _hf(mlp, x):
    with torch.no_grad():
        y, _ = mlp(x[None])
    return y[0]


def _oracle(base, pool, x, mapping, **kw):
    w, ids = _route(base, x)
    args = dict(b_gate_up=base.b_gate_up, b_down=base.b_down, activation=base.activation) | kw
    return oracle.moe_lora_forward(x, ids, w, base.w_gate_up, base.w_down, pool, mapping, **args), (w, ids)


@pytest.fixture(scope="module")
def layers():
    model = _model()
    base_mlp = model.model.layers[0].mlp
    x = _inputs()
    y_base = _hf(base_mlp, x)
    base = _base(base_mlp)
    wrapped = _peft(model)
    lora_mlp = wrapped.base_model.model.model.layers[0].mlp
    y_lora = _hf(lora_mlp, x)
    return base, lora_mlp, x, y_base, y_lora


def test_routing_equals_hf(layers):
    base, lora_mlp, x, *_ = layers
    _, hf_w, hf_ids = lora_mlp.router(x)
    w, ids = _route(base, x)
    assert_exact(ids.to(torch.int64), hf_ids.to(torch.int64), what="topk_ids")
    DEFAULT_POLICY.assert_close(w, hf_w, dtype=F32, what="topk_weights")


def test_oracle_without_adapter_equals_hf_base(layers):
    base, _, x, y_base, _ = layers
    y, _ = _oracle(base, None, x, None)
    DEFAULT_POLICY.assert_close(y, y_base, dtype=F32, what="GPT-OSS MoE base")


def test_torch_base_path_equals_hf_base(layers):
    base, _, x, y_base, _ = layers
    w, ids = base_moe.route_topk(x @ base.router.T + base.router_bias, K, True)
    y = base_moe.moe_forward(x, ids, w, base)
    DEFAULT_POLICY.assert_close(y, y_base, dtype=F32, what="base_moe GPT-OSS")


def test_oracle_with_adapter_equals_hf_peft(layers):
    base, lora_mlp, x, y_base, y_lora = layers
    pool = _pool(lora_mlp)
    mapping = torch.full((T,), 1, dtype=torch.int32)
    mapping[::3] = -1  # base rows among adapter rows
    y, _ = _oracle(base, pool, x, mapping)
    rows = mapping == 1
    DEFAULT_POLICY.assert_close(y[rows], y_lora[rows], dtype=F32, what="GPT-OSS MoE + LoRA")
    DEFAULT_POLICY.assert_close(y[~rows], y_base[~rows], dtype=F32, what="GPT-OSS MoE base rows")
    # the delta is visible: an ignored one fails by far more than the tolerance
    assert float((y_lora - y_base).norm() / y_base.norm()) > 0.1


def test_the_clamp_binds(layers):
    base, _, x, y_base, _ = layers
    g = torch.einsum("eoh,th->teo", base.w_gate_up.double(), x.double()) + base.b_gate_up.double()
    assert bool((g[..., :I] > SWIGLU_OAI.limit).any()) and bool((g[..., I:].abs() > SWIGLU_OAI.limit).any())
    unclamped = SWIGLU_OAI.__class__("swiglu_oai", alpha=SWIGLU_OAI.alpha, limit=1e9)
    y, _ = _oracle(base, None, x, None, activation=unclamped)
    assert not DEFAULT_POLICY.check(y, y_base, dtype=F32).ok
    y, _ = _oracle(base, None, x, None, activation=SILU)
    assert not DEFAULT_POLICY.check(y, y_base, dtype=F32).ok


def test_the_expert_biases_count(layers):
    base, lora_mlp, x, _, y_lora = layers
    pool = _pool(lora_mlp)
    mapping = torch.ones(T, dtype=torch.int32)
    y_ok, _ = _oracle(base, pool, x, mapping)
    DEFAULT_POLICY.assert_close(y_ok, y_lora, dtype=F32)
    for drop in ("b_gate_up", "b_down"):
        y, _ = _oracle(base, pool, x, mapping, **{drop: None})
        assert not DEFAULT_POLICY.check(y, y_lora, dtype=F32).ok, drop


def test_reading_b_halves_fails(layers):
    base, lora_mlp, x, _, y_lora = layers
    pool = _pool(lora_mlp, halves_b=True)
    y, _ = _oracle(base, pool, x, torch.ones(T, dtype=torch.int32))
    assert not DEFAULT_POLICY.check(y, y_lora, dtype=F32).ok


# --- the same through moelora's readers, from files save_pretrained wrote ------------------------


@pytest.fixture(scope="module")
def on_disk(tmp_path_factory):
    from moelora_core.checkpoint import read_adapter, read_checkpoint

    root = tmp_path_factory.mktemp("gpt_oss")
    model = _model(seed=3)
    model.save_pretrained(root / "model")
    wrapped = _peft(model)
    wrapped.save_pretrained(root / "adapter")
    weights = read_checkpoint(root / "model")
    adapter = read_adapter(root / "adapter", weights.config)
    return wrapped.base_model.model, weights, adapter


def test_readers_equal_hf_peft(on_disk):
    hf, weights, adapter = on_disk
    spec = weights.config.layer_spec(max_loras=2, max_rank=R + 2)
    x = _inputs()
    assert weights.config.layer_types == ("sliding_attention", "full_attention")
    for layer in range(2):
        mlp = hf.model.layers[layer].mlp
        base = weights.layers[layer].moe
        assert base.activation == SWIGLU_OAI
        assert set(adapter.layers[layer]) == {"gate", "up", "down"}
        pool = LoRAWeights(spec)
        pool.load_slot(1, adapter.layers[layer])
        y, (_, ids) = _oracle(base, pool, x, torch.ones(T, dtype=torch.int32))
        _, _, hf_ids = mlp.router(x)
        assert_exact(ids.to(torch.int64), hf_ids.to(torch.int64), what=f"L{layer} topk_ids")
        DEFAULT_POLICY.assert_close(y, _hf(mlp, x), dtype=F32, what=f"L{layer} GPT-OSS MoE + LoRA (readers)")
        sinks = hf.model.layers[layer].self_attn.sinks.detach()
        assert torch.equal(weights.layers[layer].sinks, sinks)
        assert torch.equal(weights.layers[layer].o_bias, hf.model.layers[layer].self_attn.o_proj.bias.detach())
