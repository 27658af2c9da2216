"""Helpers of the kernel tests (not tests themselves).

- ``DEVICE``: CUDA where present, else the CPU (kernels then run under TRITON_INTERPRET=1).
- :func:`launch_guard`: every kernel launch in the tests runs inside it; on CUDA it turns
  ``torch.cuda.set_sync_debug_mode("error")`` on, so a launcher that syncs fails the test (inputs
  are built before, results read after).
- NaN poisoning, bitwise row checks, CPU copies for the readable twins.
- :func:`compile_for_h200`: a kernel compiled for sm_90 on any machine (the interpreter accepts
  code that the GPU compiler rejects).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from moelora_core import DEFAULT_POLICY
from moelora_core.align import AlignOutput

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
ON_GPU = DEVICE.type == "cuda"


@contextlib.contextmanager
def launch_guard() -> Iterator[None]:
    """Fail on any host↔device sync inside (CUDA); a no-op on the CPU."""
    if not ON_GPU:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def poisoned(*shape: int, dtype: torch.dtype, device: torch.device = DEVICE) -> torch.Tensor:
    """A NaN-filled float tensor: an element a kernel should write and does not stays NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def poisoned_align(max_loras: int, rows: int, block_m: int, device: torch.device = DEVICE) -> AlignOutput:
    """Alignment buffers full of values no correct kernel writes (stale garbage of a previous batch)."""
    return AlignOutput(
        torch.full((max_loras, rows), 0x3FFF_FFFF, dtype=torch.int32, device=device),
        torch.full((max_loras, rows // block_m), 0x3FFF_FFFF, dtype=torch.int32, device=device),
        torch.full((max_loras,), 0x3FFF_FFFF, dtype=torch.int32, device=device),
    )


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0,
          device: torch.device = DEVICE) -> torch.Tensor:
    """Fresh N(0, scale²) values from the test's generator (never zeros)."""
    return (torch.randn(*shape, generator=gen, device=gen.device) * scale).to(device=device, dtype=dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor (NaN == NaN, -0.0 != +0.0), on the CPU; an integer tensor as it is."""
    view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}.get(t.dtype, t.dtype)
    return t.detach().cpu().contiguous().view(view)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, *, what: str, seed: int | None = None) -> None:
    """Every bit equal (for rows a kernel must leave untouched, and early exits)."""
    a, e = bits(actual), bits(expected)
    diff = a != e
    n = int(diff.sum())
    if n:
        first = diff.nonzero()[:5].tolist()
        raise AssertionError(f"{what}: {n} of {a.numel()} elements changed bits (seed={seed}); first at {first}: "
                             f"expected {[expected.cpu()[tuple(i)].item() for i in first]}, "
                             f"actual {[actual.cpu()[tuple(i)].item() for i in first]}")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype: torch.dtype, what: str,
                 seed: int | None = None) -> None:
    """The tolerance policy's norm-based check for ``dtype`` on the test device."""
    DEFAULT_POLICY.assert_close(actual, expected, dtype=dtype, device=DEVICE, what=what, seed=seed)


def cpu(value):
    """A CPU copy of a tensor / AlignOutput / None (the readable twins run on the CPU)."""
    if value is None:
        return None
    if isinstance(value, AlignOutput):
        return AlignOutput(*(t.cpu() for t in value))
    return value.detach().cpu()


def rows_mask(rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Bool [num_rows] with True at ``rows``."""
    mask = torch.zeros(num_rows, dtype=torch.bool)
    mask[rows.cpu().long()] = True
    return mask



#: Shared memory one H200 (sm_90) block may opt into, in bytes.
H200_MAX_SHARED = 232448

_COMPILE_CHILD = r"""
import collections, importlib, json, re, sys
spec = json.load(sys.stdin)
try:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource, compile
    assert get_ptxas(90).path
except Exception as exc:
    print(json.dumps({"skip": f"no Triton NVIDIA backend / ptxas: {exc}"}))
    sys.exit(0)
module, name = spec["kernel"].split(":")
kernel = getattr(importlib.import_module(module), name)
out = []
for case in spec["cases"]:
    args, consts = case["args"], dict(case["constexprs"])
    signature, attrs = {}, {}
    for i, arg in enumerate(kernel.arg_names):
        if arg in consts:
            signature[arg] = "constexpr"
        elif args[arg] is None:  # an argument the launch passes as None (a descriptor not made)
            signature[arg], consts[arg] = "constexpr", None
        elif isinstance(args[arg], dict):  # a host-side TMA descriptor: element type and block shape
            signature[arg] = f"tensordesc<{args[arg]['desc']}{list(args[arg]['block'])}>"
        elif isinstance(args[arg], str):  # a pointer's element type
            signature[arg], attrs[(i,)] = "*" + args[arg], [["tt.divisibility", 16]]
        elif isinstance(args[arg], float):
            signature[arg] = "fp32"
        elif args[arg] == 1:
            signature[arg], consts[arg] = "constexpr", 1
        else:
            signature[arg] = "i32"
            if args[arg] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    try:
        c = compile(ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs),
                    target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": case["num_warps"], "num_stages": case["num_stages"]})
        loads = re.findall(r"ld\.global[.\w]*|cp\.async\.c[ag]\.shared\.global|cp\.async\.bulk\.tensor\.\dd",
                           c.asm["ptx"])
        ptx = c.asm["ptx"]
        body = ptx[ptx.index(".entry"):]
        first = {what: (m.start() if m else -1) for what, m in (
            ("griddepcontrol.wait", re.search(r"griddepcontrol\.wait", body)),
            ("griddepcontrol.launch_dependents", re.search(r"griddepcontrol\.launch_dependents", body)),
            ("global_access", re.search(r"ld\.global|cp\.async|st\.global|atom\.global|red\.global", body)),
            ("branch", re.search(r"\bbra(\.uni)?\b|\bret;", body)))}
        out.append({"shared": c.metadata.shared, "global_loads": dict(collections.Counter(loads)),
                    "ptx_first": first})
    except Exception as exc:
        out.append({"error": f"{type(exc).__name__}: {str(exc)[-3000:]}"})
print(json.dumps({"results": out}))
"""


def compile_for_h200(kernel: str, cases: list[dict]) -> list[dict]:
    """Kernels compiled for the H200 (sm_90, through ptxas) on this machine, no GPU needed.

    The compile runs in a child Python without ``TRITON_INTERPRET`` (under the interpreter
    ``@triton.jit`` gives functions the compiler cannot take), one child for all ``cases``.

    Args:
        kernel: ``"module:name"`` of a ``@triton.jit`` kernel.
        cases: each ``{"args", "constexprs", "num_warps", "num_stages"}``; ``args`` names every
            runtime argument: a Triton element type (``"bf16"``, ``"i32"``, …) for a pointer,
            ``{"desc": type, "block": [rows, cols]}`` for a host-side TMA tensor descriptor, None for an
            argument passed as None (a constant), an int
            for an integer scalar, a float for an fp32 scalar. The launch's specialisation is reproduced: pointers and ints divisible by
            16 are marked so, ints equal to 1 become constants.

    Returns:
        Per case ``{"shared": bytes of shared memory, "global_loads": {PTX instruction: count}}`` (each
        ``ld.global…`` form, e.g. ``ld.global.b16`` for a 2-byte load, and ``cp.async.cg.shared.global``
        for an asynchronous copy, ``cp.async.bulk.tensor.2d`` for a TMA tile load, ``"ptx_first": {what:
        offset}``, where in the kernel's PTX body each of ``griddepcontrol.wait``,
        ``griddepcontrol.launch_dependents``, the first global access (``ld.global``, ``cp.async``, ``st.global``,
        ``atom.global``, ``red.global``) and the
        first branch (``bra`` or ``ret``) first appears, -1 where it does not) or ``{"error": message}``.
        Skips the test where the installed
        Triton has no NVIDIA backend or ptxas.
    """
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    proc = subprocess.run([sys.executable, "-c", _COMPILE_CHILD], input=json.dumps({"kernel": kernel, "cases": cases}),
                          capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"the sm_90 compile child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    reply = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in reply:
        pytest.skip(reply["skip"])
    return reply["results"]


def qwen3_base_args(stage, M=2048, E=128, H=2048, I=768):
    """``_fused_moe_gemm_kernel``'s runtime arguments at one Qwen3-30B-A3B base stage (bf16; the compile
    child's notation of :func:`compile_for_h200`: element types for pointers, dicts for descriptors, ints
    for sizes; ``w_ptr`` left to the caller)."""
    N, K = (2 * I, H) if stage == "gate_up" else (H, I)
    k = 8
    pairs = M * k
    return {
        "a_ptr": "bf16", "c_ptr": "bf16", "sorted_token_ids_ptr": "i32", "expert_ids_ptr": "i32",
        "num_tokens_post_padded_ptr": "i32", "topk_weights_ptr": "fp32", "scale_ptr": "i32", "bias_ptr": "i32",
        "N": N, "K": K, "num_pairs": pairs, "in_row_div": k if stage == "gate_up" else 1,
        "experts_per_scale": 1, "experts_per_weight": 1, "num_experts": E,
        "stride_am": K, "stride_ak": 1, "stride_we": N * K, "stride_wn": K, "stride_wk": 1,
        "stride_cm": N, "stride_cn": 1, "stride_bias_e": 0, "stride_bias_n": 0,
    }


def qwen3_fp8_gemm_case(bk: int, fp8_dot: bool, block_m=64, block_n=128, num_warps=4, num_stages=4,
                       pdl=False) -> dict:
    """The fp8 GEMM's gate_up launch of a Qwen3-30B-A3B-FP8-like layer (H 2048, I 768; bk as given) as a case
    of :func:`compile_for_h200`."""
    from moelora_kernels.fp8_block import k_tile

    H, inter = 2048, 768
    args = {"q_ptr": "fp8e4nv", "qs_ptr": "fp32", "w_ptr": "fp8e4nv", "ws_ptr": "fp32", "c_ptr": "bf16",
            "sorted_token_ids_ptr": "i32", "expert_ids_ptr": "i32", "num_tokens_post_padded_ptr": "i32",
            "topk_weights_ptr": "fp32", "N": 2 * inter, "K": H, "num_pairs": 4096, "in_row_div": 8, "num_experts": 128,
            "half": inter, "half_blocks": -(-inter // bk), "block_n_scale": bk,
            "stride_qm": H, "stride_qk": 1, "stride_qsm": -(-H // bk), "stride_we": 2 * inter * H, "stride_wn": H,
            "stride_wk": 1, "stride_wse": 2 * -(-inter // bk) * -(-H // bk), "stride_wsr": -(-H // bk),
            "stride_cm": 2 * inter, "stride_cn": 1}
    consts = {"BLOCK_M": block_m, "BLOCK_N": block_n, "GROUP": bk, "K_TILE": k_tile(bk), "MUL_ROUTED_WEIGHT": False,
              "FP8_DOT": fp8_dot, "DOT_PRECISION": "tf32", "PDL": pdl}
    return {"args": args, "constexprs": consts, "num_warps": num_warps, "num_stages": num_stages}


class LaunchSpy:
    """Stands in for a launcher's ``@triton.jit`` kernel (monkeypatched onto the launcher's module): appends
    ``record(args, kwargs)`` of each launch to ``seen``, then launches the real kernel."""

    def __init__(self, kernel, record):
        self.kernel, self.record, self.seen = kernel, record, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append(self.record(args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch
