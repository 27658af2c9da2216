"""The expert activation of an MoE block and the layout of its gate/up columns (DESIGN.md §1).

Two activations (computed in fp32 by every path: the oracle in float64):

- ``"silu"`` (SwiGLU of Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE): ``h = silu(g) ⊙ u``.
- ``"swiglu_oai"`` (GPT-OSS, transformers 5.17 ``GptOssExperts._apply_gate``):
  ``g' = min(g, limit)``, ``u' = clamp(u, -limit, limit)``, ``h = g' · sigmoid(α g') ⊙ (u' + 1)``
  with α = 1.702 and limit = 7.0 in GPT-OSS. The clamp comes after the LoRA delta and the bias.

Two layouts of a [.., 2I] gate_up row:

- ``"halves"``: gate = columns [0, I), up = [I, 2I) (moelora's layout on the backend protocol;
  the readers convert every checkpoint to it).
- ``"interleaved"``: gate = column 2i, up = column 2i + 1 (GPT-OSS's ``gate_up_proj``, as SGLang
  keeps it): the checkpoint readers and the reference's split (``moelora_reference.base_moe``) know
  it; moelora's kernels take halves only.
"""

from __future__ import annotations

from dataclasses import dataclass

from moelora_core.errors import InvalidFieldError

ACTIVATION_KINDS: tuple[str, ...] = ("silu", "swiglu_oai")
GATE_UP_LAYOUTS: tuple[str, ...] = ("halves", "interleaved")


@dataclass(frozen=True)
class MoEActivation:
    """The gated activation of one MoE block.

    Attributes:
        kind: "silu" or "swiglu_oai".
        alpha: the sigmoid's slope α of "swiglu_oai" (GPT-OSS: 1.702); ignored for "silu".
        limit: the clamp bound of "swiglu_oai" (GPT-OSS: 7.0); ignored for "silu".

    Raises:
        InvalidFieldError: an unknown kind, or a limit that is not positive.
    """

    kind: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATION_KINDS:
            raise InvalidFieldError("activation.kind", f"{self.kind!r} not in {ACTIVATION_KINDS}")
        if not self.limit > 0:
            raise InvalidFieldError("activation.limit", f"must be > 0, got {self.limit}")


SILU = MoEActivation("silu")
#: GPT-OSS's clamped SwiGLU (transformers ``GptOssExperts``: alpha 1.702, limit 7.0).
SWIGLU_OAI = MoEActivation("swiglu_oai", alpha=1.702, limit=7.0)


def check_layout(layout: str) -> str:
    """``layout`` itself when it is one of :data:`GATE_UP_LAYOUTS`.

    Raises:
        InvalidFieldError: any other value.
    """
    if layout not in GATE_UP_LAYOUTS:
        raise InvalidFieldError("layout", f"{layout!r} not in {GATE_UP_LAYOUTS}")
    return layout
