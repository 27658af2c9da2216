"""``benchmarks/sweep_configs.py --variants --dry-run`` on the CPU, as benchmarks/README.md documents it:
the interpreter, tiny shapes, one LoRA unit. It once failed there with "Torch not compiled with CUDA
enabled" when the units began to read their card's targets (``variants._card_targets``): with no GPU a
unit has no target, and the run still writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_variants_dry_run_runs_on_the_cpu_with_no_target(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sweep_configs.py"), "--variants", "--dry-run",
                           "--families", "b", "--lora-tokens", "8", "--ranks", "16", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads((tmp_path / "variants.json").read_text())
    assert data["dry_run"] is True
    assert [(u["M"], u["R"], u["target_us"]) for u in data["lora"]] == [(8, 16, None)]
