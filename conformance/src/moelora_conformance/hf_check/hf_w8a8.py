"""transformers' model of an fp8 block-scaled checkpoint made w8a8: the HF side of E02 on an fp8 base.

transformers 5.17 on a CPU cannot run an fp8 checkpoint as stored: its fine-grained fp8 quantizer
needs a GPU (the Triton ``finegrained-fp8`` kernel from the hub) and, without one, sets
``quantization_config.dequantize`` and loads Ŵ = W_q · scale_inv (weights only, fp32 here; the
block taken from the scale grid, right where every dimension is a multiple of it). That model is w8a16;
the served semantics are w8a8 (DESIGN.md §1, "Quantized base"). :func:`make_w8a8` adds the one rule
transformers leaves out, on the modules stored fp8 (those with a ``weight_scale_inv`` on disk):

- each fp8 dense projection (an ``nn.Linear``; attention, the shared expert) gets a forward pre-hook
  that replaces its input by v̂ (the oracle's ``fp8_group_quantize``, row by row). peft's ``lora.Linear``
  calls its base layer with x and its LoRA path with x, so the delta still reads the unquantized x;
- each fp8 experts module gets :func:`w8a8_experts_forward` (transformers' eager expert loop) in
  place of its forward. peft applies expert LoRA by parametrising ``gate_up_proj`` / ``down_proj``
  (W + ΔW while the adapter is active), so the loop takes the base products on v̂ from the original
  parameter and the delta products on v from the difference: x̂ Wᵀ + x ΔWᵀ, h = act(gate) ⊙ up,
  ĥ W_dᵀ + h ΔW_dᵀ, times the routing weight — the LoRA rule of DESIGN.md §1.

A checkpoint with partial edge blocks, which transformers refuses or mis-dequantizes, is loaded from
:func:`dequantized_copy` (the oracle's dequantized weights, no ``quantization_config``) and made w8a8
alike. Everything else (embedding, attention, norms, routing, the LM head, peft's factors and σ) is
transformers' and peft's own. Nothing here shares code with the engine: the activation quantization
is the oracle's fp64 emulation (``moelora_reference.oracle``), not the engine's torch path.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from torch.nn.utils import parametrize

from moelora_core.errors import MoeLoraError


class W8A8ReferenceError(MoeLoraError):
    """transformers' dequantized model cannot be made the w8a8 reference (named module and why)."""


#: Called with every activation quantization of a model made w8a8 while set (``fp8_crossings``, which
#: finds and flips e4m3 crossings): tap(where, v [R, K] fp64, quotients [R, K] fp64, s [R, K] fp64,
#: v̂ [R, K] fp64, tokens [R] int64) → the v̂ to use (the oracle's ``fp8_group_quotients`` of each row:
#: v̂ = e4m3(quotients) · s). ``where`` names the module and which input; row r is token tokens[r].
_TAP = None


def _quantize_rows(v: torch.Tensor, block_k: int, where: str = "", tokens: torch.Tensor | None = None) -> torch.Tensor:
    """v [..., K] → v̂ of the same shape and dtype, each row quantized per K-group by the oracle.
    ``where`` and ``tokens`` (the sequence position of each row; default: the row's index in v's
    second-to-last dimension) are for :data:`_TAP` alone."""
    from moelora_reference.oracle import e4m3_round, fp8_group_quotients

    flat = v.reshape(-1, v.shape[-1])
    if not flat.shape[0]:
        return v
    quotients, scales = (torch.stack(t) for t in zip(*(fp8_group_quotients(row, block_k) for row in flat)))
    out = e4m3_round(quotients) * scales  # the oracle's fp8_group_quantize, row by row
    if _TAP is not None:
        if tokens is None:
            tokens = torch.arange(flat.shape[0]) % (v.shape[-2] if v.dim() > 1 else 1)
        out = _TAP(where, flat.double(), quotients, scales, out, tokens)
    return out.to(v.dtype).reshape(v.shape)


def _base_and_delta(module: torch.nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(W, ΔW) of the expert parameter ``name``: ΔW is peft's active delta (None without one)."""
    if parametrize.is_parametrized(module, name):
        base = getattr(module.parametrizations, name).original
        return base, getattr(module, name) - base
    return getattr(module, name), None


def w8a8_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor, *, quantized_deltas: bool = False) -> torch.Tensor:
    """transformers' eager expert loop (``Qwen3MoeExperts.forward``) with w8a8 base products and
    unquantized delta products (module doc). hidden_states [T, H]; top_k_index, top_k_weights [T, k];
    returns [T, H] in hidden_states' dtype. ``self._w8a8_block_k`` is the checkpoint's bk.
    ``quantized_deltas``: the delta products read x̂ and ĥ instead (a fault, for
    ``fp8_crossings.measure``: what the fp8 logprob rows must fail)."""
    bk = self._w8a8_block_k
    w_gu, d_gu = _base_and_delta(self, "gate_up_proj")
    w_d, d_d = _base_and_delta(self, "down_proj")
    out = torch.zeros_like(hidden_states)
    mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
        pos, tok = torch.where(mask[e])
        x = hidden_states[tok]
        where = f"{getattr(self, '_w8a8_name', 'experts')} expert {e}"
        x_hat = _quantize_rows(x, bk, f"{where} gate_up input", tok)
        gate_up = torch.nn.functional.linear(x_hat, w_gu[e])
        if d_gu is not None:
            gate_up = gate_up + torch.nn.functional.linear(x_hat if quantized_deltas else x, d_gu[e])
        h = self._apply_gate(gate_up)
        h_hat = _quantize_rows(h, bk, f"{where} down input", tok)
        y = torch.nn.functional.linear(h_hat, w_d[e])
        if d_d is not None:
            y = y + torch.nn.functional.linear(h_hat if quantized_deltas else h, d_d[e])
        out.index_add_(0, tok, (y * top_k_weights[tok, pos, None]).to(out.dtype))
    return out


def _scaled_modules(model_dir: Path) -> set[str]:
    """Module names with a ``weight_scale_inv`` on disk (the modules stored fp8)."""
    from safetensors import safe_open

    names = set()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            names |= {k.removesuffix(".weight_scale_inv") for k in f.keys() if k.endswith(".weight_scale_inv")}
    return names


def fp8_block(model_dir: Path) -> tuple[int, int] | None:
    """config.json's ``weight_block_size`` when its ``quantization_config`` is fp8, else None."""
    qc = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("quant_method") != "fp8":
        return None
    return tuple(qc["weight_block_size"])


def partial_block_weights(model_dir: Path) -> list[str]:
    """The fp8 weights of ``model_dir`` (those with a ``weight_scale_inv``) whose shape its block does not
    divide: partial edge blocks, which transformers 5.17 mis-dequantizes or refuses on a CPU (it takes
    the block from the scale grid). Empty for an unquantized checkpoint."""
    from safetensors import safe_open

    block = fp8_block(model_dir)
    if block is None:
        return []
    partial = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
            for key in sorted(keys):
                if key.endswith(".weight_scale_inv"):
                    weight = key.removesuffix("_scale_inv")
                    shape = tuple(f.get_slice(weight).get_shape()) if weight in keys else ()
                    if len(shape) == 2 and (shape[0] % block[0] or shape[1] % block[1]):
                        partial.append(weight)
    return partial


#: Unquantized copies made by :func:`dequantized_copy` in this process: checkpoint → copy.
_COPIES: dict[Path, Path] = {}


def dequantized_copy(model_dir: Path) -> Path:
    """An unquantized copy of the fp8 checkpoint ``model_dir`` that transformers loads as it is (made once
    per process, in a temporary folder removed at exit): every fp8 weight replaced by the oracle's
    ``fp8_dequantize`` (fp64, rounded once to fp32; partial edge blocks as the format defines them),
    its ``weight_scale_inv`` dropped, every other tensor as stored, config.json without its
    ``quantization_config``, the other files copied. Loaded, it is the w8a16 model transformers would
    build where the block divides every dimension (the same fp32 weights, bit for bit): nothing of the
    engine or of moelora's readers takes part.

    Raises:
        W8A8ReferenceError: ``model_dir`` is not an fp8 block-scaled checkpoint.
    """
    import atexit
    import shutil
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file

    from moelora_reference.oracle import fp8_dequantize

    model_dir = Path(model_dir).resolve()
    if model_dir in _COPIES:
        return _COPIES[model_dir]
    block = fp8_block(model_dir)
    if block is None:
        raise W8A8ReferenceError(f"{model_dir}: not an fp8 block-scaled checkpoint (no quantization_config "
                                 "with quant_method 'fp8')")
    out = Path(tempfile.mkdtemp(prefix="moelora-hf-dequantized-"))
    atexit.register(shutil.rmtree, out, True)
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors |= {k: f.get_tensor(k) for k in f.keys()}
    state = {}
    for key, t in tensors.items():
        if key.endswith(".weight_scale_inv"):
            continue
        scale = tensors.get(key.removesuffix(".weight") + ".weight_scale_inv") if key.endswith(".weight") else None
        state[key] = (t if scale is None else fp8_dequantize(t, scale, block).to(torch.float32)).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.startswith("model"):
            shutil.copy2(f, out / f.name)
    _COPIES[model_dir] = out
    return out


#: A per-expert weight's module name on disk: (layer prefix, block, expert, leaf).
_EXPERT_KEY = re.compile(r"^(.*\.layers\.\d+)\.(\w+)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)$")
#: Disk leaf → gate / up / down (Mixtral's w1 / w3 / w2).
_EXPERT_LEAVES = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def make_w8a8(model: torch.nn.Module, model_dir: Path) -> torch.nn.Module:
    """Make transformers' dequantized model of the fp8 checkpoint ``model_dir`` w8a8 (module doc), in
    place, before peft wraps it. Returns ``model``.

    Raises:
        W8A8ReferenceError: the checkpoint is not fp8 block-scaled; a module stored fp8 has no
            transformers module (a name this rule does not know: fused experts stored fp8, say); a
            weight of transformers' (a dense projection, an expert's gate/up or down) is not W_q ·
            scale_inv of its blocks (the oracle's ``fp8_dequantize``; transformers infers the block
            from the scale grid, wrong for partial edge blocks).
    """
    from safetensors import safe_open

    from moelora_reference.oracle import fp8_dequantize

    block = fp8_block(model_dir)
    if block is None:
        raise W8A8ReferenceError(f"{model_dir}: not an fp8 block-scaled checkpoint (no quantization_config "
                                 "with quant_method 'fp8')")
    scaled = _scaled_modules(model_dir)
    modules = dict(model.named_modules())
    disk = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            disk |= {k: f.get_tensor(k) for k in f.keys() if k.rsplit(".", 1)[0] in scaled}

    def dequantized(name: str) -> torch.Tensor:
        return fp8_dequantize(disk[f"{name}.weight"], disk[f"{name}.weight_scale_inv"], block)

    def check(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got.detach(), want.to(got.dtype)):  # the fp64 product, rounded once as transformers'
            raise W8A8ReferenceError(f"{model_dir}: transformers' dequantized {what} is not W_q · scale_inv of its "
                                     f"{block[0]}x{block[1]} blocks (partial edge blocks: transformers infers the "
                                     "block from the scale grid)")

    def quantize_input(module, args):
        return (_quantize_rows(args[0], block[1], f"{module._w8a8_name} input"), *args[1:])

    experts_of: dict[str, dict[int, dict[str, str]]] = {}
    for name in sorted(scaled):
        if m := _EXPERT_KEY.match(name):
            experts_of.setdefault(m.group(1), {}).setdefault(int(m.group(3)), {})[_EXPERT_LEAVES[m.group(4)]] = name
            continue
        linear = modules.get(name)
        if not isinstance(linear, torch.nn.Linear):
            raise W8A8ReferenceError(f"{model_dir}: {name} is stored fp8 but transformers has no linear of that name")
        check(name, linear.weight, dequantized(name))
        linear._w8a8_name = name
        linear.register_forward_pre_hook(quantize_input)
    for layer, per_expert in sorted(experts_of.items()):
        found = [m for n, m in modules.items() if n.startswith(layer + ".") and n.endswith(".experts")
                 and hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]
        if len(found) != 1:
            raise W8A8ReferenceError(f"{model_dir}: {layer} stores fp8 experts but transformers has "
                                     f"{len(found)} fused experts modules there")
        experts = found[0]
        for e, leaves in sorted(per_expert.items()):
            check(f"{layer} expert {e} gate/up", experts.gate_up_proj[e],
                  torch.cat([dequantized(leaves["gate"]), dequantized(leaves["up"])]))
            check(f"{layer} expert {e} down", experts.down_proj[e], dequantized(leaves["down"]))
        experts._w8a8_block_k, experts._w8a8_name = block[1], layer
        experts.forward = w8a8_experts_forward.__get__(experts)
    return model
