"""LoRA adapter configuration: rank, alpha, rsLoRA and per-module patterns → per-module rank and σ.

Follows PEFT's ``LoraConfig`` semantics (peft 0.21):

- ``rank_pattern`` / ``alpha_pattern`` map a key to a value; a key applies to a module whose
  dotted path ends with the key (``re.match(rf"(.*\\.)?({key})$", path)``), the first matching key
  in file order wins, otherwise ``r`` / ``lora_alpha`` apply.
- σ = α / r (Hu et al. 2021, "LoRA", arXiv:2106.09685) or α / √r with rsLoRA (Kalajdzievski
  2023, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA", arXiv:2312.03732), with
  r and α those of the module as written in the adapter file (DESIGN.md §1).

σ is applied at run time from fp32 ``scalings`` (never folded into B), so this module only
computes it.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from moelora_core.errors import InvalidFieldError

#: The largest σ the fp32 ``scalings`` tables hold (``torch.finfo(torch.float32).max``).
FP32_MAX: float = 3.4028234663852886e38


def fp32_scaling(field: str, value: object) -> float:
    """``value`` as a σ that an fp32 ``scalings`` table holds exactly as a finite number.

    Args:
        field: the field named in the error (``"adapter['q'].scaling"``, ``"scalings[2]"``).
        value: an int or float (numpy scalars included); not a bool, a string or a tensor.

    Returns:
        ``float(value)``.

    Raises:
        InvalidFieldError: not a real number, NaN/Inf, or ``|value|`` above the fp32 maximum
            (a finite Python float such as 1.25e39 becomes Inf in fp32).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidFieldError(field, f"must be a real number (int or float), got {type(value).__name__} {value!r}")
    s = float(value)
    if not math.isfinite(s):
        raise InvalidFieldError(field, f"must be finite, got {s}")
    if abs(s) > FP32_MAX:
        raise InvalidFieldError(field, f"{s:.6g} overflows fp32 (σ is applied from fp32 tables; |σ| <= {FP32_MAX:.6g})")
    return s


def lora_scaling(rank: int, alpha: float, use_rslora: bool) -> float:
    """σ for one module: ``alpha / rank``, or ``alpha / sqrt(rank)`` with rsLoRA.

    Args:
        rank: the module's LoRA rank r (>= 1).
        alpha: the module's lora_alpha α.
        use_rslora: rank-stabilised scaling.

    Returns:
        σ as a Python float (callers store it as fp32).

    Raises:
        InvalidFieldError: ``rank < 1``, a non-finite α, or a σ that overflows fp32 (field
            ``scaling``).
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidFieldError("rank", f"must be an int >= 1, got {rank!r}")
    if not math.isfinite(float(alpha)):
        raise InvalidFieldError("lora_alpha", f"must be finite, got {alpha!r}")
    sigma = float(alpha) / (math.sqrt(rank) if use_rslora else rank)
    label = f"σ = α/{'√' if use_rslora else ''}r = {float(alpha):g}/{'√' if use_rslora else ''}{rank}"
    if abs(sigma) > FP32_MAX:
        raise InvalidFieldError("scaling", f"{label} = {sigma:.6g} overflows fp32 (|σ| <= {FP32_MAX:.6g})")
    return sigma


def _pattern_key(patterns: Mapping[str, object], module_path: str) -> str | None:
    """The first key of ``patterns`` matching the end of ``module_path`` (PEFT's rule), or None."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module_path):
            return key
    return None


@dataclass(frozen=True)
class AdapterConfig:
    """The parts of a PEFT ``adapter_config.json`` that decide a module's rank and σ.

    Attributes:
        r: default rank.
        lora_alpha: default α.
        use_rslora: σ = α/√r instead of α/r.
        rank_pattern: module-path suffix → rank, overriding ``r``.
        alpha_pattern: module-path suffix → α, overriding ``lora_alpha``.

    Raises (on construction):
        InvalidFieldError: a rank < 1, a non-finite α, or a pattern key that is not a valid
        regular expression.
    """

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        lora_scaling(self.r, self.lora_alpha, self.use_rslora)  # validates r and α
        for name, patterns in (("rank_pattern", self.rank_pattern), ("alpha_pattern", self.alpha_pattern)):
            for key, value in patterns.items():
                try:
                    re.compile(key)
                except re.error as exc:
                    raise InvalidFieldError(f"{name}[{key!r}]", f"not a valid pattern: {exc}") from None
                if name == "rank_pattern":
                    lora_scaling(value, self.lora_alpha, self.use_rslora)
                elif not math.isfinite(float(value)):
                    raise InvalidFieldError(f"{name}[{key!r}]", f"must be finite, got {value!r}")
        # Freeze the mappings so a shared config cannot change under a loaded slot.
        object.__setattr__(self, "rank_pattern", MappingProxyType(dict(self.rank_pattern)))
        object.__setattr__(self, "alpha_pattern", MappingProxyType(dict(self.alpha_pattern)))

    def rank_for(self, module_path: str) -> int:
        """The rank of the module at ``module_path`` (e.g. ``model.layers.0.mlp.experts``)."""
        key = _pattern_key(self.rank_pattern, module_path)
        return int(self.rank_pattern[key]) if key is not None else self.r

    def alpha_for(self, module_path: str) -> float:
        """The α of the module at ``module_path``."""
        key = _pattern_key(self.alpha_pattern, module_path)
        return float(self.alpha_pattern[key]) if key is not None else float(self.lora_alpha)

    def scaling_for(self, module_path: str, rank: int | None = None) -> float:
        """σ of the module at ``module_path``.

        Args:
            module_path: dotted module path as PEFT names it.
            rank: the module's rank as found in the file, when the caller read it from tensor
                shapes; defaults to :meth:`rank_for`.
        """
        r = self.rank_for(module_path) if rank is None else rank
        return lora_scaling(r, self.alpha_for(module_path), self.use_rslora)
