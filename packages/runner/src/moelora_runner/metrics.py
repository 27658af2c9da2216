"""The engine's Prometheus metrics (prometheus_client), one registry per engine.

================================================  ===================  ===============================================
metric                                            labels               counts
================================================  ===================  ===============================================
``moelora_forward_passes_total``                  phase, mode, reason  forward passes; phase prefill | decode | idle,
                                                                       mode eager | full | breakable | decode_graph;
                                                                       reason "" for a graph pass, else why it ran
                                                                       eagerly: disabled (no graph for the phase),
                                                                       over_tokens, over_requests, backend_fallback
                                                                       (``moelora_runner.graph_runner.REASONS``)
``moelora_tokens_total``                          kind                 prompt tokens computed, output tokens generated
``moelora_requests_finished_total``               finish_reason        requests that ended (stop | length | error)
``moelora_adapter_loads_total``                                        slot loads (first loads and reloads)
``moelora_adapter_evictions_total``                                    adapters evicted from a slot to load another
``moelora_adapter_refusals_total``                error                adapters the reader or a pool refused, by class
``moelora_step_latency_seconds``                  phase                wall time of one ``Engine.step`` (histogram)
``moelora_requests_running`` / ``_waiting``                            requests now running / queued (gauges)
``moelora_kv_cache_used_tokens``                                       reserved KV locations (gauge)
================================================  ===================  ===============================================

``EngineMetrics.text()`` is the text exposition (``--metrics-file``); ``serve(port)`` starts the
client's own HTTP server on the registry (``--metrics-port``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

#: Step latency buckets (seconds): CPU interpreter steps take seconds, GPU steps milliseconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class EngineMetrics:
    """The metrics of one engine (see the module table). ``registry`` is what ``Engine.metrics`` returns."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.forward_passes = Counter("moelora_forward_passes", "Forward passes by phase, mode and reason",
                                      ["phase", "mode", "reason"], registry=r)
        self.tokens = Counter("moelora_tokens", "Tokens computed (prompt) and generated (output)", ["kind"],
                              registry=r)
        self.requests_finished = Counter("moelora_requests_finished", "Requests finished, by finish reason",
                                         ["finish_reason"], registry=r)
        self.adapter_loads = Counter("moelora_adapter_loads", "Adapter slot loads (first loads and reloads)",
                                     registry=r)
        self.adapter_evictions = Counter("moelora_adapter_evictions", "Adapters evicted from a slot", registry=r)
        self.adapter_refusals = Counter("moelora_adapter_refusals", "Adapters refused, by error class", ["error"],
                                        registry=r)
        self.step_latency = Histogram("moelora_step_latency_seconds", "Wall time of one engine step", ["phase"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("moelora_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("moelora_requests_waiting", "Requests waiting", registry=r)
        self.kv_used = Gauge("moelora_kv_cache_used_tokens", "KV cache locations reserved", registry=r)

    def adapter_event(self, kind: str, detail: str) -> None:
        """The adapter pool's events ("load", "evict", "refusal" with the error class)."""
        if kind == "load":
            self.adapter_loads.inc()
        elif kind == "evict":
            self.adapter_evictions.inc()
        elif kind == "refusal":
            self.adapter_refusals.labels(error=detail).inc()

    def forward_pass(self, phase: str, mode: str, reason: str) -> None:
        self.forward_passes.labels(phase=phase, mode=mode, reason=reason).inc()

    def value(self, name: str, **labels: str) -> float:
        """One sample's value (0.0 when it has not been recorded), e.g. ``value("moelora_tokens_total",
        kind="prompt")``."""
        v = self.registry.get_sample_value(name, labels)
        return 0.0 if v is None else v

    def text(self) -> str:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry).decode()

    def serve(self, port: int, addr: str = "127.0.0.1"):
        """Serve the registry over HTTP (prometheus_client's server); returns (server, thread)."""
        return start_http_server(port, addr=addr, registry=self.registry)
