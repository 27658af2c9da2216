"""Build the git-ignored folder that carries the peers to the GPU machine (Python 3.12, no internet,
64 MiB per carry): ``python packages/peers/scripts/build_gpu_folder.py [OUT]`` (default ``.gpu/peers``,
which .gitignore's ``/.gpu/`` keeps out of every commit).

Contents:

- ``OUT/root/``: the peers' files the adapters load (each finder's ``loaded`` list, collected by
  ``moelora_peers.collect``: every module of ``MODULES`` and ``LAZY_MODULES``, imported here and
  again with the stubs' platform answering CUDA sm90, so the CUDA-only import branches are taken)
  plus the trees those files read at run time or import only on CUDA (:data:`EXTRA_TREES`: SGLang's
  JIT sources and tuned tables, its plan tables, vLLM's LoRA ops), and each release's
  ``*.dist-info/METADATA`` (``MOELORA_PEERS_ROOT=OUT/root`` points the finders there). Copied from
  the installed releases (``pip install --no-deps``), unchanged; no compiled extension is copied;
- ``OUT/wheels/``: cp312 manylinux wheels of the small libraries ``ci/constraints/peers.txt`` pins
  (msgspec, pydantic and its two pure dependencies) and SGLang's JIT runtime ``apache-tvm-ffi``
  (the legacy path's CUDA align compiles through it), fetched with ``pip download --no-deps
  --only-binary=:all: --python-version 3.12``;
- ``OUT/README.txt``: the commands to run on the GPU machine.

Checks the built folder: every module imports from ``OUT/root`` alone as on CUDA sm90 (fails with
the import's traceback otherwise). Refuses (exit 1) if the folder would pass the carry limit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from moelora_peers.loader import ROOT_ENV

REPO = Path(__file__).resolve().parents[3]
CARRY_LIMIT = 64 * 1024 * 1024
#: Trees copied whole (beside the loaded files): read at run time, or imported only on CUDA.
EXTRA_TREES = {
    "sglang": ["sglang/kernels/jit", "sglang/kernels/ops/lora", "sglang/kernels/ops/moe/moe_align.py",
               "sglang/srt/lora/moe", "sglang/srt/layers/moe/moe_runner/triton_utils",
               # fp8_kernel.py's CUDA-only ``from sglang.kernels.ops.quantization import
               # sgl_per_token_quant_fp8`` reads the package init (a kernel-registry wrapper, in
               # sglang_modules.RUN_INIT); the init and the three registry modules it imports are
               # copied whole.
               "sglang/kernels/ops/quantization/__init__.py", "sglang/kernels/registry.py",
               "sglang/kernels/spec.py", "sglang/kernels/selector.py"],
    "vllm": ["vllm/lora/ops/triton_ops", "vllm/lora/punica_wrapper"],
}
#: (requirement, why) of the cp312 wheels; versions from ci/constraints/peers.txt where pinned there.
WHEELS = ["msgspec==0.23.0", "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
          "typing-inspection==0.4.5", "apache-tvm-ffi==0.1.11"]
#: The compute capability the folder is collected and checked for (the H100s of the GPU matrix).
GPU_CAPABILITY = "9.0"


def collect(peer: str, as_cuda: str | None = None, root: Path | None = None) -> dict:
    """The peer's root, version and loaded files: ``python -m moelora_peers.collect`` in a fresh
    process (every module and lazy import of the paths), on this device or ``as_cuda``, from the
    installed release or from ``root`` (``MOELORA_PEERS_ROOT``).

    Raises:
        subprocess.CalledProcessError: a module does not import (its traceback is printed).
    """
    env = dict(os.environ)
    env.pop(ROOT_ENV, None)
    if root is not None:
        env[ROOT_ENV] = str(root)
    cmd = [sys.executable, "-m", "moelora_peers.collect", peer, *(["--as-cuda", as_cuda] if as_cuda else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        print(proc.stderr, file=sys.stderr)
        proc.check_returncode()
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
        # the CPU collection misses the peers' CUDA-only import branches; the as-CUDA one takes them
        info, on_cuda = collect(peer), collect(peer, GPU_CAPABILITY)
        root = Path(info["root"])
        for rel in sorted(set(info["loaded"]) | set(on_cuda["loaded"])):
            copy_file(root / rel, root_out / rel)
        for rel in EXTRA_TREES[peer]:
            copy_tree(root, rel, root_out)
        dist = next(root.glob(f"{peer}-{info['version']}.dist-info"))
        copy_file(dist / "METADATA", root_out / dist.name / "METADATA")
        print(f"{peer} {info['version']}: {len(info['loaded'])} loaded files (+{len(on_cuda['loaded'])} as CUDA "
              f"{GPU_CAPABILITY}) + {len(EXTRA_TREES[peer])} trees")
        # the folder alone must serve every import as on the GPU (the first H100 run's ImportError)
        collect(peer, GPU_CAPABILITY, root_out)
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
