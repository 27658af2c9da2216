"""Build the git-ignored folder that carries the peers to the GPU machine (Python 3.12, no internet,
64 MiB per carry): ``python packages/peers/scripts/build_gpu_folder.py [OUT]`` (default ``.gpu/peers``,
which .gitignore's ``/.gpu/`` keeps out of every commit).

Contents:

- ``OUT/root/``: the peers' files the adapters load (each finder's ``loaded`` list, collected by
  importing every module of ``moelora_peers.sglang_modules.MODULES`` / ``vllm_modules.MODULES`` here)
  plus the trees those files read at run time or import only on CUDA (:data:`EXTRA_TREES`: SGLang's
  JIT sources and tuned tables, its plan tables, vLLM's LoRA ops), and each release's
  ``*.dist-info/METADATA`` (``MOELORA_PEERS_ROOT=OUT/root`` points the finders there). Copied from
  the installed releases (``pip install --no-deps``), unchanged; no compiled extension is copied;
- ``OUT/wheels/``: cp312 manylinux wheels of the small libraries ``ci/constraints/peers.txt`` pins
  (msgspec, pydantic and its two pure dependencies) and SGLang's JIT runtime ``apache-tvm-ffi``
  (the legacy path's CUDA align compiles through it), fetched with ``pip download --no-deps
  --only-binary=:all: --python-version 3.12``;
- ``OUT/README.txt``: the commands to run on the GPU machine.

Refuses (exit 1) if the folder would pass the carry limit.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CARRY_LIMIT = 64 * 1024 * 1024
#: Trees copied whole (beside the loaded files): read at run time, or imported only on CUDA.
EXTRA_TREES = {
    "sglang": ["sglang/kernels/jit", "sglang/kernels/ops/lora", "sglang/kernels/ops/moe/moe_align.py",
               "sglang/srt/lora/moe", "sglang/srt/layers/moe/moe_runner/triton_utils",
               # fp8_kernel.py's CUDA-only ``from sglang.kernels.ops.quantization import
               # sgl_per_token_quant_fp8`` reads the package init (a kernel-registry wrapper), which a
               # CPU collection never runs (first H100 run: ImportError at fp8_kernel.py:42); the
               # init and the three registry modules it imports are copied whole.
               "sglang/kernels/ops/quantization/__init__.py", "sglang/kernels/registry.py",
               "sglang/kernels/spec.py", "sglang/kernels/selector.py"],
    "vllm": ["vllm/lora/ops/triton_ops", "vllm/lora/punica_wrapper"],
}
#: (requirement, why) of the cp312 wheels; versions from ci/constraints/peers.txt where pinned there.
WHEELS = ["msgspec==0.23.0", "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
          "typing-inspection==0.4.5", "apache-tvm-ffi==0.1.11"]
#: Modules the paths import lazily, inside a call (not among ``MODULES``), or only on CUDA (behind an
#: ``if _is_cuda:`` that is false where this script runs): imported here too, so their files and
#: imports are collected (regressions: the virtual-experts expand's base kernel was missing; then
#: the CUDA-only JIT quantization modules ``quantization/fp8_kernel.py`` and ``int8_kernel.py``
#: import, with ``kernel_api_logging`` and ``srt/utils/custom_op``).
LAZY_IMPORTS = {
    "sglang": ["sglang.kernels.ops.moe.fused_moe_triton_kernels",
               "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config",
               "sglang.kernels.ops.quantization.per_tensor_quant_fp8",
               "sglang.kernels.ops.quantization.per_token_group_quant",
               "sglang.kernels.ops.quantization.per_token_quant_fp8"],
    "vllm": [],
}
_COLLECT = """
import json, sys
from moelora_peers import {peer}_modules as m
for short in m.MODULES:
    m.module(short)
for name in {lazy!r}:
    m.import_peer(m.importer(), name)
print(json.dumps({{"root": str(m.importer().dist.root), "version": m.importer().dist.version,
                  "loaded": m.importer().loaded}}))
"""


def collect(peer: str) -> dict:
    """The peer's root, version and loaded files (imported in a fresh process)."""
    code = _COLLECT.format(peer=peer, lazy=LAZY_IMPORTS[peer])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    import json

    return json.loads(proc.stdout.strip().splitlines()[-1])


def copy_file(src: Path, dst: Path) -> None:
    if src.suffix in (".so", ".pyc") or "__pycache__" in src.parts:
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)


def copy_tree(root: Path, rel: str, out: Path) -> None:
    src = root / rel
    if src.is_file():
        copy_file(src, out / rel)
        return
    for f in src.rglob("*"):
        if f.is_file():
            copy_file(f, out / f.relative_to(root))


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=str(REPO / ".gpu" / "peers"))
    ap.add_argument("--no-wheels", action="store_true", help="skip pip download (files only)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    root_out = out / "root"
    for peer in ("sglang", "vllm"):
        info = collect(peer)
        root = Path(info["root"])
        for rel in info["loaded"]:
            copy_file(root / rel, root_out / rel)
        for rel in EXTRA_TREES[peer]:
            copy_tree(root, rel, root_out)
        dist = next(root.glob(f"{peer}-{info['version']}.dist-info"))
        copy_file(dist / "METADATA", root_out / dist.name / "METADATA")
        print(f"{peer} {info['version']}: {len(info['loaded'])} loaded files + {len(EXTRA_TREES[peer])} trees")
    if not args.no_wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                        "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
                        "-d", str(out / "wheels"), *WHEELS], check=True)
    (out / "README.txt").write_text(
        "moelora peers for the GPU machine (built by packages/peers/scripts/build_gpu_folder.py; never commit)\n"
        "From the repository root:\n"
        "  packages/peers/scripts/run_gpu.sh [OUT_DIR]\n")
    total = size_of(out)
    print(f"{out}: {total / 2**20:.1f} MiB (carry limit {CARRY_LIMIT / 2**20:.0f} MiB)")
    if total > CARRY_LIMIT:
        print("over the carry limit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
