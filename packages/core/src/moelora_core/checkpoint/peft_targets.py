"""Which modules a PEFT LoRA config targets (peft 0.21.2's rules), and the adapter keys it does not.

peft builds the LoRA wrappers from the *config*, then loads the file's keys into them with
``load_state_dict(strict=False)``: a key for a module it did not wrap is dropped without a warning.
A file holding such keys disagrees with its config; moelora refuses it (serving the keys would add
deltas peft never applies; dropping them silently would be a silent no-op) with an
:class:`~moelora_core.checkpoint.errors.AdapterFormatError` that lists the keys and the config
fields that leave them out.

Module targets follow ``peft.tuners.tuners_utils.check_target_module_exists`` exactly (a parity
test runs it next to :func:`targets_module`), with the module path as the model names it
(``model.layers.0.self_attn.q_proj``, legacy ``model.layers.0.mlp.experts.3.gate_proj``):

1. ``exclude_modules``: a string is a regex that must match the whole path; a list excludes a path
   equal to an entry or ending with ``"." + entry``.
2. ``target_modules`` None → nothing (with ``target_parameters`` set, as peft's saved configs
   have it); a string → ``"all-linear"`` (every linear layer but the LM head: the attention and
   legacy expert projections) or a regex that must match the whole path; a list → equal to an
   entry (no layer filter then), or ending with ``"." + entry`` and then filtered by
3. ``layers_to_transform`` (an int or a list), with the layer index read after one of
   ``layers_pattern`` (``<pattern>.<idx>.``) or, without a pattern, after the first ``<name>.``
   that follows a dotted prefix (``model.layers.<idx>.``).

Fused expert keys are governed by ``target_parameters`` alone: peft 0.21.2 wraps every parameter
whose path equals or ends with an entry and applies neither ``exclude_modules`` nor
``layers_to_transform`` to them, so neither does moelora (the fused ``experts`` keys of every layer
are served, as peft serves them). Which parameter each fused wrapper holds is resolved by the
adapter reader, which refuses fused keys that ``target_parameters`` does not name.

Legacy per-expert keys are matched as the modules they name (the transformers v4 modules the file
was trained on). peft 0.21.2 on transformers 5 first rewrites such a config to
``target_parameters`` and so stops applying ``exclude_modules`` / ``layers_to_transform`` to them;
where the two readings disagree, the file and its config disagree, and moelora refuses the keys.
"""

from __future__ import annotations

import re

from moelora_core.checkpoint.adapter_keys import LoraKey
from moelora_core.checkpoint.errors import AdapterFormatError
from moelora_core.checkpoint.peft_config import PeftAdapterConfig

_ALL_LINEAR = "all-linear"


def _excluded(cfg: PeftAdapterConfig, path: str) -> bool:
    ex = cfg.exclude_modules
    if not ex:
        return False
    if isinstance(ex, str):
        return re.fullmatch(ex, path) is not None
    return path in ex or any(path.endswith(f".{e}") for e in ex)


def _layer_index(cfg: PeftAdapterConfig, path: str) -> int | None:
    """The layer index peft reads from ``path`` for ``layers_to_transform`` (None: no index)."""
    if not cfg.layers_pattern:
        # Lazy: the first numbered component, not an expert index further down.
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", path)
    else:
        match = None
        for pattern in cfg.layers_pattern:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", path)
            if match is not None:
                break
    return int(match["idx"]) if match else None


def targets_module(cfg: PeftAdapterConfig, path: str) -> bool:
    """Whether peft 0.21.2 wraps the module at ``path`` (``model.layers.0.self_attn.q_proj``) with
    LoRA under ``cfg``'s ``target_modules`` / ``exclude_modules`` / ``layers_to_transform`` /
    ``layers_pattern`` (see the module docstring for the rules).

    ``modules_to_save`` is not consulted: a config with any is refused before keys are read.
    """
    if _excluded(cfg, path):
        return False
    targets = cfg.target_modules
    if targets is None:
        return False
    if isinstance(targets, str):
        if targets.lower() == _ALL_LINEAR:
            return True  # callers only ask about attention and expert projections, all nn.Linear
        return re.fullmatch(targets, path) is not None
    if path in targets:
        return True  # an exact path: peft applies no layer filter
    if not any(path.endswith(f".{t}") for t in targets):
        return False
    indexes = cfg.layers_to_transform
    if indexes is None or indexes == ():
        return True
    idx = _layer_index(cfg, path)
    if idx is None:
        return False
    return idx == indexes if isinstance(indexes, int) else idx in indexes


def _describe_targets(cfg: PeftAdapterConfig) -> str:
    fields = [f"target_modules={cfg.target_modules!r}" if not isinstance(cfg.target_modules, tuple)
              else f"target_modules={list(cfg.target_modules)}"]
    if cfg.exclude_modules:
        ex = cfg.exclude_modules
        fields.append(f"exclude_modules={list(ex) if isinstance(ex, tuple) else repr(ex)}")
    if cfg.layers_to_transform is not None and cfg.layers_to_transform != ():
        ltt = cfg.layers_to_transform
        fields.append(f"layers_to_transform={list(ltt) if isinstance(ltt, tuple) else ltt}")
    if cfg.layers_pattern:
        fields.append(f"layers_pattern={list(cfg.layers_pattern)}")
    return ", ".join(fields)


def refuse_untargeted(keys: list[LoraKey], cfg: PeftAdapterConfig, adapter: str) -> None:
    """Refuse the adapter if it holds keys of modules its config does not target.

    Args:
        keys: the classified keys (:func:`~moelora_core.checkpoint.adapter_keys.classify_keys`).
        cfg: the adapter's config.
        adapter: the adapter's name, for the message.

    Raises:
        AdapterFormatError: dense or legacy per-expert keys of modules :func:`targets_module`
            says peft does not wrap (up to 5 listed, with the count and the config fields).
    """
    bad = [k.key for k in keys if k.kind in ("dense", "expert") and not targets_module(cfg, k.module_path)]
    if bad:
        shown = ", ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
        raise AdapterFormatError(
            adapter, shown, f"{len(bad)} key(s) of modules the config does not target ({_describe_targets(cfg)}); "
            "peft would not load them, so the file and its config disagree",
        )
