"""Why a conformance run executed nothing, in words (the run then exits 5, pytest's "no tests ran").

A run in which no property item executed, or in which every item was "not implemented", tested
nothing — a Triton backend started on a CPU without ``TRITON_INTERPRET=1`` declares no CPU device
and skips all 84 items in seconds. :func:`no_run_cause` names the likely cause from the records'
skip reasons, the run's device and the environment.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Sequence

from moelora_conformance.report import EXECUTED


def executed_nothing(records: Sequence[dict]) -> bool:
    """True when records exist and none of them executed (every one not implemented or not run)."""
    return bool(records) and not any(r["outcome"] in EXECUTED for r in records)


def no_run_cause(records: Sequence[dict], *, device: str, declared_devices: Sequence[str],
                 environ: dict[str, str] | None = None) -> str:
    """The likely cause of a run that executed nothing, with what to do.

    Args:
        records: the run's records. device: the ``--device`` of the run.
        declared_devices: the devices the backend declares.
        environ: the environment (default ``os.environ``).
    """
    environ = os.environ if environ is None else environ
    reasons = Counter(r.get("reason", "") or r["outcome"] for r in records)
    common, n = reasons.most_common(1)[0]
    lines = [f"no property item executed: {n} of {len(records)} items: {common}"]
    if device.partition(":")[0] not in declared_devices:
        lines.append(f"the backend declares devices {sorted(declared_devices)}; this run is on {device} "
                     f"(--device / MOELORA_DEVICE)")
        if device == "cpu" and environ.get("TRITON_INTERPRET") != "1":
            triton = "triton" in sys.modules
            lines.append(("the backend imported triton: " if triton else "")
                         + "a Triton backend runs on a CPU only under the Triton interpreter: "
                           "export TRITON_INTERPRET=1 before starting pytest (Triton reads it at import)")
    elif all(r["outcome"] == "not_implemented" for r in records):
        lines.append("the backend declares none of the dtypes, graph families or features this profile asks for "
                     "(see the capabilities in the report header)")
    else:
        lines.append("every item was skipped before it ran; the reasons are in the report's records")
    return "\n".join(lines)
