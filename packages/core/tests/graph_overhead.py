"""Replay overhead of the graph emulator vs eager (and vs CUDA graphs on a GPU), for the docs.

The representative program is one layer as the suite's harness runs it: a dense LoRA projection
(x W + σ·(x A) B), a graph-safe segment-mean "attention" from static buffers, and a top-k MoE
layer (router, softmax, top-k, gathered expert weights): 21 recorded ops.

    python packages/core/tests/graph_overhead.py [--device cpu|cuda] [--tokens 64]

Prints, per mode, the median time per forward over repeated runs (after warm-up).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from moelora_core.graphs import GraphPool


def build_layer(device: torch.device, tokens: int, hidden: int = 64, rank: int = 16, experts: int = 8, top_k: int = 2):
    """Static inputs and the captured callable of the representative layer."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    x, w, a, b = rand(tokens, hidden), rand(hidden, hidden), rand(hidden, rank), rand(rank, hidden)
    sigma = torch.tensor(0.5, device=device)
    seg_ids = (torch.arange(tokens) // 8).to(device)  # 8-token requests
    router, expert_w = rand(hidden, experts), rand(experts, hidden, hidden) / hidden

    def forward() -> torch.Tensor:
        h = x @ w + sigma * ((x @ a) @ b)
        sums = torch.zeros(tokens, hidden, device=device).index_add_(0, seg_ids, h)
        counts = torch.zeros(tokens, device=device).index_add_(0, seg_ids, torch.ones(tokens, device=device))
        h = (sums / counts.clamp(min=1.0)[:, None])[seg_ids]
        probs = torch.softmax(h @ router, dim=-1)
        topk_w, topk_ids = torch.topk(probs, top_k, dim=-1)
        per_expert = torch.einsum("th,tkho->tko", h, expert_w[topk_ids])
        return (topk_w[..., None] * per_expert).sum(1)

    return x, forward


def _median_us(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(device: torch.device | str, tokens: int = 64, repeats: int = 200) -> dict[str, float]:
    """Median µs per forward: eager, emulated replay (and CUDA graph replay on CUDA)."""
    device = torch.device(device)
    _, forward = build_layer(device, tokens)
    results = {"eager": _median_us(forward, device, repeats)}
    emulated = GraphPool("prefill", device, kind="emulated").capture(forward, warmup=2)
    results["emulated replay"] = _median_us(emulated.replay, device, repeats)
    results["emulated ops"] = emulated.num_ops
    if device.type == "cuda":
        cuda = GraphPool("prefill", device, kind="cuda").capture(forward, warmup=2)
        results["cuda graph replay"] = _median_us(cuda.replay, device, repeats)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    res = measure(args.device, args.tokens, args.repeats)
    ops = int(res.pop("emulated ops"))
    print(f"device {args.device}, {args.tokens} tokens, {ops} recorded ops, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    for name, us in res.items():
        print(f"  {name:20} {us:9.1f} µs  ({us / res['eager']:.2f}x eager)")
    print(f"  emulator overhead per op: {(res['emulated replay'] - res['eager']) / ops:.1f} µs")


if __name__ == "__main__":
    main()
