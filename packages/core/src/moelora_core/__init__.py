"""moelora_core: the types and contracts every moelora package shares (DESIGN.md §3, §5, §7).

A reader of DESIGN.md finds its names here:

- sentinels: ``NO_ADAPTER``, ``EXPERT_NOT_HERE``, ``NO_EXPERT_BLOCK``        (:mod:`.sentinels`)
- ``ForwardMode`` EXTEND / DECODE / IDLE                                    (:mod:`.forward_mode`)
- ``AdapterConfig`` (r, α, rsLoRA, rank_pattern / alpha_pattern → rank, σ)  (:mod:`.adapter_config`)
- ``Request``, ``BatchSpec``                                                (:mod:`.batch`)
- ``LoRABatchInfo``                                                        (:mod:`.batch_info`)
- ``LoRALayerSpec``                                                         (:mod:`.layer_spec`)
- ``LoRAWeights`` with ``load_slot``, ``ModuleLoRA``                        (:mod:`.weights`)
- ``Capabilities``, ``Fallback``                                            (:mod:`.capabilities`)
- ``Backend`` protocol, ``load_backend``, ``check_protocol``                (:mod:`.backend`)
- ``GraphCapacity`` (a graph family's or bucket's capacity)                (:mod:`.backend_checks`)
- ``AlignOutput``, ``align_capacity`` (moe_lora_align_block_size contract) (:mod:`.align`)
- ``MoEBaseWeights``                                                       (:mod:`.base_weights`)
- ``SharedExpertWeights``, ``shared_expert_forward`` (Qwen2-MoE)          (:mod:`.shared_expert`)
- ``StaticBuffer``                                                          (:mod:`.static_buffer`)
- ``PinnedStaging``                                                         (:mod:`.staging`)
- ``TolerancePolicy``, ``DEFAULT_POLICY``, ``assert_exact``                 (:mod:`.tolerance`)
- ``LogprobTolerance``, ``logprob_tolerance``, ``LogprobCheck``, ``assert_logprobs_close``
  (:mod:`.tolerance`; engine-level absolute-logprob rows)
"""

from moelora_core.adapter_config import AdapterConfig, lora_scaling
from moelora_core.align import AlignOutput, align_capacity
from moelora_core.backend import BUILTIN_BACKENDS, Backend, BackendFactory, check_protocol, load_backend
from moelora_core.backend_checks import GraphCapacity
from moelora_core.base_weights import MoEBaseWeights
from moelora_core.batch import BatchSpec, Request
from moelora_core.batch_info import LoRABatchInfo
from moelora_core.capabilities import GRAPH_FAMILIES, PREFILL_GRAPH_MODES, Capabilities, Fallback
from moelora_core.errors import (
    AdapterError,
    HostSyncError,
    InvalidFieldError,
    KernelPreconditionError,
    MoeLoraError,
    RenamedError,
    SlotError,
    UnsupportedBaseQuantError,
)
from moelora_core.forward_mode import ForwardMode
from moelora_core.layer_spec import (
    ALL_MODULES,
    DENSE_LORA_MODULES,
    DENSE_MLP_MODULES,
    DENSE_MODULES,
    EXPERT_FACTORS,
    EXPERT_LAYOUTS,
    MLA_MODULES,
    MOE_MODULES,
    SHARED_EXPERT_MODULES,
    LoRALayerSpec,
)
from moelora_core.routing import GroupLimitedRouting
from moelora_core.sentinels import EXPERT_NOT_HERE, NO_ADAPTER, NO_EXPERT_BLOCK, padding_row
from moelora_core.shared_expert import SharedExpertWeights, shared_expert_forward
from moelora_core.staging import PinnedStaging
from moelora_core.static_buffer import StaticBuffer
from moelora_core.tolerance import (
    DEFAULT_POLICY,
    LOGPROB_COMPARISONS,
    CloseReport,
    LogprobCheck,
    LogprobTolerance,
    Tolerance,
    TolerancePolicy,
    assert_exact,
    assert_logprobs_close,
    logprob_tolerance,
)
from moelora_core.weights import LoRAWeights, ModuleLoRA, module_index

__version__ = "0.1.0"

__all__ = [
    "ALL_MODULES",
    "BUILTIN_BACKENDS",
    "DEFAULT_POLICY",
    "DENSE_LORA_MODULES",
    "DENSE_MLP_MODULES",
    "DENSE_MODULES",
    "EXPERT_FACTORS",
    "EXPERT_LAYOUTS",
    "EXPERT_NOT_HERE",
    "GRAPH_FAMILIES",
    "LOGPROB_COMPARISONS",
    "MLA_MODULES",
    "MOE_MODULES",
    "NO_ADAPTER",
    "NO_EXPERT_BLOCK",
    "PREFILL_GRAPH_MODES",
    "SHARED_EXPERT_MODULES",
    "AdapterConfig",
    "AdapterError",
    "AlignOutput",
    "Backend",
    "BackendFactory",
    "BatchSpec",
    "Capabilities",
    "CloseReport",
    "Fallback",
    "ForwardMode",
    "GraphCapacity",
    "GroupLimitedRouting",
    "HostSyncError",
    "InvalidFieldError",
    "KernelPreconditionError",
    "LoRABatchInfo",
    "LoRALayerSpec",
    "LoRAWeights",
    "LogprobCheck",
    "LogprobTolerance",
    "MoEBaseWeights",
    "ModuleLoRA",
    "MoeLoraError",
    "PinnedStaging",
    "RenamedError",
    "Request",
    "SharedExpertWeights",
    "SlotError",
    "StaticBuffer",
    "Tolerance",
    "TolerancePolicy",
    "UnsupportedBaseQuantError",
    "align_capacity",
    "assert_exact",
    "assert_logprobs_close",
    "check_protocol",
    "load_backend",
    "logprob_tolerance",
    "lora_scaling",
    "module_index",
    "padding_row",
    "shared_expert_forward",
]


def __getattr__(name: str) -> object:
    if name == "MoELoRABatchInfo":
        from moelora_core import batch_info

        return batch_info.__getattr__(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
