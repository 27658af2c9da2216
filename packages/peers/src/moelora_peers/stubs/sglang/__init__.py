"""Stand-ins for SGLang 0.5.23 server modules (see ``moelora_peers.stubs``)."""
