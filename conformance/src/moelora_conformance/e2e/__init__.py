"""The e2e suite on the engine (DESIGN.md §9): a ragged mixed workload over every backend × engine
mode (eager, decode graph, prefill ``full``, prefill ``breakable``), graph vs eager, engine vs
HF + PEFT, the metrics proving which path ran, and the stateful engine properties; run by
``moelora-conformance e2e``.

- :mod:`.results`: the record every part returns (:class:`~.results.E2EResult`).
- :mod:`.properties`: the stable e2e property ids.

Nothing is imported here: the package imports without the engine or transformers installed.
"""
