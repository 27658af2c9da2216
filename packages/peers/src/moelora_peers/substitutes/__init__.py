"""CPU substitutes: stand-ins for a peer's CUDA-only helpers, used only on a machine without CUDA.

Each is the peer's own torch fallback where it has one (called, not rewritten), otherwise a
documented stand-in. The finder maps the peer module to its substitute only when no CUDA device is
present (``moelora_peers.sglang_modules.CPU_SUBSTITUTES``); every cell a substitute touched is
marked "CPU substitute" in ``.reports/peers.json`` (conformance/docs/peers.md, "CPU substitutes").
"""
