"""A user's own checkpoint and PEFT adapters for ``hf-check`` and ``checkpoint-pass``
(``--model DIR --adapter NAME=DIR ...``), as a :class:`~moelora_conformance.fixtures.manifest.FixtureSet`
whose manifest is made from the files — no hand-written manifest.

What each adapter must mean comes from the files, independently of moelora's readers (the values
the checks compare the readers against):

- adapters peft loads as they are (fused ``target_parameters``, attention-only): every module's rank
  and σ as peft's own in-memory layers hold them after ``PeftModel.from_pretrained``
  (``fixtures.adapters.peft_module_table``), so rsLoRA, ``rank_pattern`` and ``alpha_pattern`` are
  peft's reading;
- legacy per-expert adapters (peft converts them to a fused one on load, DESIGN.md §1): per module,
  the rank of its ``lora_A`` in the file and σ = α/r (α/√r with ``use_rslora``), α from
  ``alpha_pattern`` matched by peft's own ``get_pattern_key`` on the module's path, else
  ``lora_alpha``. Legacy + rsLoRA is the documented peft divergence (``peft_divergent``).

A directory that is not a checkpoint or an adapter is refused with :class:`UserFilesError` naming
what is missing (no traceback; the commands exit 2).

What each adapter changes is measured as the engine measures it (``moelora_core.checkpoint.adapter_effect``,
on the checkpoint's layers read one at a time): each entry's ``noop`` is why the adapter is a no-op ("" when
it is not) and ``warnings`` what to tell the user at load; the checks of a no-op adapter are "not
meaningful" (:func:`noop_adapters`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from pathlib import Path

from moelora_conformance.fixtures.manifest import VERSION, FixtureSet
from moelora_conformance.fixtures.specs import POOL_MAX_RANK

#: Legacy per-expert key: ``...layers.L.<block>.experts.E.<leaf>.lora_A.weight``.
_LEGACY = re.compile(r"layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.lora_A\.weight$")
_DENSE = re.compile(r"layers\.(\d+)\.self_attn\.(q|k|v|o)_proj\.lora_A\.weight$")
_LEAF = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


class UserFilesError(ValueError):
    """A ``--model`` / ``--adapter`` argument that is not usable (the message says what is missing)."""


def parse_adapters(values: Sequence[str] | None) -> dict[str, Path]:
    """``NAME=DIR`` arguments → {name: directory}.

    Raises:
        UserFilesError: an argument without ``=``, an empty name or directory, a name given twice.
    """
    out: dict[str, Path] = {}
    for value in values or []:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise UserFilesError(f"--adapter {value!r}: expected NAME=DIR (an adapter name, '=', its directory)")
        if name in out:
            raise UserFilesError(f"--adapter {name!r} is given twice")
        out[name.strip()] = Path(path.strip())
    return out


def check_model_dir(path: Path) -> None:
    """Raise :class:`UserFilesError` naming what is missing unless ``path`` is a readable MoE checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise UserFilesError(f"--model {path}: not a directory")
    missing = [f for f in ("config.json",) if not (path / f).is_file()]
    if not any(path.glob("*.safetensors")):
        pickled = sorted(p.name for p in (*path.glob("*.bin"), *path.glob("*.pt")))
        missing.append("model.safetensors (or *.safetensors shards)"
                       + (f"; {', '.join(pickled)} not read (pickled weights)" if pickled else ""))
    if missing:
        raise UserFilesError(f"--model {path} is not a Hugging Face checkpoint: missing {'; '.join(missing)}")
    from moelora_core.checkpoint import CheckpointError, MoECheckpoint

    try:
        with MoECheckpoint(path):
            pass
    except CheckpointError as exc:
        raise UserFilesError(f"--model {path}: {exc}") from None


def check_adapter_dir(name: str, path: Path) -> dict:
    """The adapter's ``adapter_config.json`` contents, or :class:`UserFilesError` naming what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise UserFilesError(f"--adapter {name}={path}: not a directory")
    missing = [f for f in ("adapter_config.json", "adapter_model.safetensors") if not (path / f).is_file()]
    if "adapter_model.safetensors" in missing and (path / "adapter_model.bin").is_file():
        missing[-1] += " (adapter_model.bin is not read: pickled weights)"
    if missing:
        raise UserFilesError(f"--adapter {name}={path} is not a PEFT adapter: missing {', '.join(missing)}")
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserFilesError(f"--adapter {name}={path}: adapter_config.json is not valid JSON ({exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("r"), int):
        raise UserFilesError(f"--adapter {name}={path}: adapter_config.json has no integer 'r'")
    return config


def _legacy_modules(path: Path, config: dict) -> dict[str, dict[str, dict[str, float]]]:
    """layer → module → {rank, scaling} of a legacy per-expert adapter, from its file (module doc)."""
    from peft.utils.other import get_pattern_key
    from safetensors import safe_open

    alpha, patterns = config.get("lora_alpha", 8), config.get("alpha_pattern") or {}
    table: dict[str, dict[str, dict[str, float]]] = {}
    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        for key in sorted(f.keys()):
            match = _LEGACY.search(key) or _DENSE.search(key)
            if match is None:
                continue
            layer = match.group(1)
            module = _LEAF.get(match.group(3)) if match.re is _LEGACY else match.group(2)
            if module is None:
                continue
            r = int(f.get_slice(key).get_shape()[0])
            module_path = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            a = patterns.get(get_pattern_key(list(patterns), module_path), alpha)
            sigma = a / math.sqrt(r) if config.get("use_rslora") else a / r
            table.setdefault(layer, {})[module] = {"rank": r, "scaling": float(sigma)}
    return table


class _Layers:
    """A checkpoint's decoder layers read on demand, the last one kept (the probe visits them in order)."""

    def __init__(self, ckpt) -> None:
        self.ckpt, self.index, self.layer = ckpt, None, None

    def __getitem__(self, index: int):
        if index != self.index:
            self.index, self.layer = index, self.ckpt.layer(index)
        return self.layer


def _check_readable(name: str, path: Path, model_dir: Path):
    """moelora's reader must accept the adapter for the model (its refusal, named, otherwise); returns
    what the adapter changes (``adapter_effect`` with the checkpoint's base weights)."""
    from moelora_core.checkpoint import MoECheckpoint, adapter_effect, read_adapter
    from moelora_core.errors import MoeLoraError

    with MoECheckpoint(model_dir) as ckpt:
        try:
            read = read_adapter(path, ckpt.config, name=name)
        except MoeLoraError as exc:
            raise UserFilesError(f"--adapter {name}={path}: refused by moelora's adapter reader: "
                                 f"{type(exc).__name__}: {exc}") from None
        return adapter_effect(read, _Layers(ckpt))


def noop_adapters(fixtures: FixtureSet) -> dict[str, str]:
    """Adapter name → why it is a no-op, for the no-op adapters of a user fixture set (empty otherwise)."""
    return {name: e["noop"] for name, e in fixtures.manifest["adapters"].items() if e.get("noop")}


def _format(path: Path) -> str:
    from safetensors import safe_open

    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        return "per_expert" if any(_LEGACY.search(k) for k in f.keys()) else "fused"


def user_fixture_set(model_dir: Path, adapters: dict[str, Path]) -> FixtureSet:
    """The user's files as a fixture set (module doc): one model named after its directory, every
    adapter with the expected ranks and σ read from the files. Needs transformers + peft.

    Raises:
        UserFilesError: the model or an adapter directory is not usable (what is missing, named).
    """
    from moelora_conformance.fixtures.adapters import peft_module_table
    from moelora_conformance.hf_check.hf_model import load_hf

    model_dir = Path(model_dir).resolve()
    check_model_dir(model_dir)
    if not adapters:
        raise UserFilesError("--model needs at least one --adapter NAME=DIR")
    model = model_dir.name
    entries, rank = {}, POOL_MAX_RANK
    for name, path in adapters.items():
        path = Path(path).resolve()
        config = check_adapter_dir(name, path)
        effect = _check_readable(name, path, model_dir)
        fmt = _format(path)
        if fmt == "per_expert":
            modules = _legacy_modules(path, config)
        else:
            try:
                modules = peft_module_table(load_hf(model_dir, path))
            except Exception as exc:  # peft's own refusal of the pair: named, not a traceback
                first = (str(exc).splitlines() or [""])[0]
                raise UserFilesError(f"--adapter {name}={path}: transformers + peft cannot load it on --model "
                                     f"{model_dir}: {type(exc).__name__}: {first}") from None
        ranks = [m["rank"] for layer in modules.values() for m in layer.values()] or [1]
        rank = max(rank, 1 << max(0, math.ceil(math.log2(max(ranks)))))
        divergent = fmt == "per_expert" and bool(config.get("use_rslora")) and any(
            m in layer for layer in modules.values() for m in ("gate", "up"))
        entries[name] = {"path": str(path), "model": model, "format": fmt, "kinds": ["user", fmt],
                         "r": int(config["r"]), "lora_alpha": config.get("lora_alpha"),
                         "use_rslora": bool(config.get("use_rslora")), "peft_divergent": divergent,
                         "modules": modules, "noop": effect.reason(), "warnings": list(effect.warnings())}
    manifest = {"version": VERSION, "source": "user", "pool_max_rank": rank,
                "models": {model: {"path": str(model_dir)}}, "adapters": entries, "bad_adapters": {}}
    return FixtureSet(Path("/"), manifest)


def pool_max_rank(fixtures: FixtureSet) -> int:
    """R of the pools the checks build: the fixtures' 16, or a user set's largest rank rounded up."""
    return int(fixtures.manifest.get("pool_max_rank", POOL_MAX_RANK))
