"""moelora_reference: the readable oracle and the vectorised, graph-safe reference backend.

The oracle (:mod:`moelora_reference.oracle`) is the shortest obviously-right code for the one
equation of DESIGN.md §1; everything else in moelora is judged against it, and it is itself checked
against Hugging Face transformers + PEFT on locally built checkpoints. This package imports neither
transformers nor peft.
"""

__version__ = "0.1.0"
