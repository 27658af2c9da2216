"""moelora_reference: the readable oracle, the kernels' readable twins, and the vectorised,
graph-safe reference backend.

The oracle (:mod:`moelora_reference.oracle`) is the shortest obviously-right code for the one
equation of DESIGN.md §1; everything else in moelora is judged against it, and it is itself checked
against Hugging Face transformers + PEFT on locally built checkpoints. This package imports neither
transformers nor peft.

- metadata twins: :mod:`.mapping` (token→adapter), :mod:`.align` (``moe_lora_align_block_size`` and
  the contract checker ``check_alignment``), :mod:`.segments`, :mod:`.virtual_experts`;
- GEMM twins: :mod:`.fused_moe`, :mod:`.moe_lora_ops`, :mod:`.sgmv`;
- the graph-safe torch path: :mod:`.base_moe` (base MoE) and :mod:`.backend` (the ``reference``
  backend, ``make_backend``).
"""

__version__ = "0.1.0"
