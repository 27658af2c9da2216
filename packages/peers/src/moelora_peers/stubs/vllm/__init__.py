"""Stand-ins for vLLM server modules (see ``moelora_peers.stubs``)."""
