"""Stand-ins for the server modules the peers' kernel modules import at their top.

One module per replaced peer module, named after it (``sglang/srt_utils_common.py`` replaces
``sglang.srt.utils.common``). Each provides only the names the kernel modules and call sites we run
import, with the behaviour those names have on the device at hand (a platform check answers for the
real device; a TP collective that the layer suite never reaches raises). The list, with what each
provides, is in conformance/docs/peers.md; ``moelora_peers.sglang`` / ``moelora_peers.vllm`` map
peer module names to these.
"""
