"""The real-checkpoint pass (the main job, DESIGN.md §8): every backend × layer mode on real tiny MoE
checkpoints and PEFT adapters, against the oracle and HF transformers + PEFT per adapter.

- :mod:`.adapters`: the adapters of each model (three made here of different ranks — one rsLoRA,
  one legacy per-expert — plus the model's faithful fixture adapters);
- :mod:`.batches`: the mixed EXTEND and DECODE batches (more than 32 requests, lengths above 1);
- :mod:`.run`: the pass (:func:`run_checkpoint_pass`, :class:`PassRow`);
- :mod:`.table`: the summary table;
- :mod:`.command`: ``moelora-conformance checkpoint-pass``.

Needs the ``fixtures`` extra (transformers + peft). The package itself imports nothing, so the CLI
registers the subcommand without loading torch or the harness.
"""
