"""The e2e suite over backends × models (:func:`run_e2e`), the expected-failure manifest applied
to its records, and its JSON report — the layer suite's report format (``suite: "e2e"``), so
``moelora-conformance report`` and the support matrix render it (:mod:`moelora_conformance.report`).

CI-sized default (:func:`default_models`): every fixture family with ``reference``, one family per
other backend (``triton``: qwen3_moe, ``csgmv``: mixtral, any ``module:factory``: qwen3_moe).
"""

from __future__ import annotations

import copy
import platform
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from moelora_conformance.e2e.properties import E2E_PROPERTIES
from moelora_conformance.e2e.results import E2E_MODES, MIXED_MODE, E2EResult
from moelora_conformance.e2e.run import E2EConfig, run_model
from moelora_conformance.manifest import Manifest, load_manifest

#: The one fixture family each kernel backend runs in the CI-sized default.
KERNEL_BACKEND_FAMILY = {"triton": "qwen3_moe", "csgmv": "mixtral"}
#: The family of any other backend (``module:factory``) in the CI-sized default.
DEFAULT_FAMILY = "qwen3_moe"


def default_models(backend: str) -> list[str]:
    """The CI-sized fixture families of ``backend`` (module doc)."""
    from moelora_conformance.e2e.adapters import model_names

    if backend == "reference":
        return model_names()
    return [KERNEL_BACKEND_FAMILY.get(backend, DEFAULT_FAMILY)]


def load_e2e_manifest(path: str | Path | None) -> Manifest:
    """The layer suite's manifest format with the e2e property ids and engine modes.

    Raises:
        InvalidFieldError: as :func:`moelora_conformance.manifest.load_manifest`.
    """
    return load_manifest(path, set(E2E_PROPERTIES), known_modes={*E2E_MODES, MIXED_MODE})


def apply_manifest(records: list[E2EResult], manifest: Manifest) -> list[str]:
    """Expected failures: a matching failed record becomes ``xfailed``, a matching one that held (passed,
    partial or not meaningful) ``xpassed`` (a stale entry fails the run, as in the layer suite). Returns the
    entries that matched no record."""
    matched = set()
    for r in records:
        entry = manifest.match(r.property, r.mode, r.dtype)
        if entry is None:
            continue
        matched.add(entry.index)
        if r.outcome == "failed":
            r.outcome, r.message = "xfailed", f"{entry.reason} (was: {r.message})"
        elif r.outcome in ("passed", "partial", "not_meaningful"):  # it held: the entry is stale
            r.outcome, r.message = "xpassed", f"manifest entry passed (stale): {entry.reason}"
    return [e.describe() for e in manifest.entries if e.index not in matched]


def run_e2e(backend: str, models: list[tuple], *, config: E2EConfig,
            dtype: str = "float32", device: str = "cpu", manifest: Manifest | None = None, hf: bool = True,
            record_path: str | Path | None = None,
            progress: Callable[[E2EResult], None] | None = None, rerun_extra: list[str] | tuple[str, ...] = (),
            warn: Callable[[str], None] | None = None, write: Callable[[dict], None] | None = None) -> dict:
    """The e2e suite of one backend on every (model name, model dir, adapters[, rerun inputs]) of
    ``models``; the report (module doc). E06 runs once per backend, on the first model.

    ``rerun_extra``: options every rerun line ends with (``run.rerun_line``); ``warn``: called with each
    adapter warning at load (they are also kept in the report's ``adapter_warnings``); ``write``: called
    with the report so far (``"complete": False``, every finished claim, the manifest applied) after each
    claim finishes, and with the final report (``"complete": True``): a run cut short (a timeout, Ctrl-C)
    leaves a report of every claim that finished."""
    start = time.perf_counter()
    records: list[E2EResult] = []
    warnings: list[str] = []

    def warned(message: str) -> None:
        if message not in warnings:
            warnings.append(message)
            (warn or (lambda m: None))(message)

    def report(done: list[E2EResult], complete: bool) -> dict:
        if complete:
            unmatched = apply_manifest(done, manifest) if manifest is not None else []
        else:  # the manifest applied to copies: the final pass applies it to the records once
            done = [copy.deepcopy(r) for r in done]
            unmatched = apply_manifest(done, manifest) if manifest is not None else []
        return {"suite": "e2e", "backend": {"name": backend.rsplit(":", 1)[-1] if ":" in backend else backend,
                                            "target": backend, "version": ""},
                "profile": "e2e", "device": device, "dtype": dtype, "duration": time.perf_counter() - start,
                "complete": complete, "config": asdict(config), "models": [m[0] for m in models],
                "manifest": str(manifest.path) if manifest is not None and manifest.path else None,
                "manifest_unmatched": unmatched if complete else [], "python": platform.python_version(),
                "adapter_warnings": list(warnings), "records": [r.to_record() for r in done]}

    finished: list[E2EResult] = []

    def finish(rec: E2EResult) -> None:
        finished.append(rec)
        if write is not None:  # written before anything else can stop the run
            write(report(finished, False))
        if progress is not None:
            progress(rec)

    for i, (name, model_dir, adapters, *inputs) in enumerate(models):
        cfg = config if i == 0 else _without_state_machine(config)
        records += run_model(backend, model_dir, adapters, config=cfg, dtype=dtype, device=device, model_name=name,
                             hf=hf, record_path=record_path, progress=finish, inputs=inputs[0] if inputs else None,
                             rerun_extra=rerun_extra, warn=warned)
    final = report(records, True)
    if write is not None:
        write(final)
    return final


def _without_state_machine(config: E2EConfig) -> E2EConfig:
    from dataclasses import replace

    return replace(config, state_machine_examples=0)
