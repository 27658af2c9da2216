"""The peers' files load as released, through the stubs, and what the analysis in
conformance/docs/peers.md says of SGLang's own helpers still holds for the installed release.

Covers: ``sglang/__init__.py`` and ``vllm/__init__.py`` never run (their packages are shells); every
file the finders load is the release's own; every module and lazy import of both peers imports with
the stubs answering CUDA sm90 (the peers' CUDA-only branches); the stubs answer for the real device,
and vLLM's ``is_device_capability`` with vLLM's meaning; the peer
behaviours the grid's manifests cite (docs "F1" and "F2") on the smallest cases that show them.
Runs in ``nox -s peers`` (the peers installed with ``--no-deps``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from moelora_peers import sglang_modules, vllm_modules
from moelora_peers.stubs._platform import is_cuda

I32 = torch.int32


@pytest.mark.parametrize("peer", [sglang_modules, vllm_modules], ids=["sglang", "vllm"])
def test_package_init_never_runs_and_files_are_the_release(peer) -> None:
    for short in peer.MODULES:
        peer.module(short)
    importer = peer.importer()
    top = sys.modules[importer.dist.name]
    assert top.__doc__.startswith("shell of"), "the peer's own __init__.py ran"
    assert importer.loaded, "no peer file was loaded"
    for rel in importer.loaded:
        assert (importer.dist.root / rel).is_file(), rel
        assert not rel.endswith(f"{importer.dist.name}/__init__.py")


@pytest.mark.parametrize("peer", ["sglang", "vllm"])
def test_every_module_imports_as_on_cuda(peer) -> None:
    # SGLang's quantization/fp8_kernel.py imports sgl_per_token_quant_fp8 from its package init on
    # CUDA only (the virtual-experts expand's base kernel imports it): a CPU import never takes the
    # branch, and the init is served only if RUN_INIT names it. A fresh process: the finders and the
    # platform answers are per process.
    proc = subprocess.run([sys.executable, "-m", "moelora_peers.collect", peer, "--as-cuda", "9.0"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])["loaded"]
    if peer == "sglang":
        assert "sglang/kernels/ops/quantization/__init__.py" in loaded
        assert "sglang/kernels/ops/quantization/fp8_kernel.py" in loaded


@pytest.mark.parametrize(("cap", "asked", "expected"), [
    ((9, 0), (9, 0), True), ((9, 0), 90, True),     # the H100: vLLM's sm90 NUM_STAGES workaround applies
    ((9, 0), (8, 9), False), ((10, 0), 90, False),  # exact, not "at least" (has_device_capability)
    (None, 90, False),                              # no CUDA
])
def test_vllm_is_device_capability_means_exactly_this_capability(monkeypatch, cap, asked, expected) -> None:
    platforms = vllm_modules.import_peer(vllm_modules.importer(), "vllm.platforms")
    stub = sys.modules[platforms.__stub__]
    monkeypatch.setattr(stub, "cuda_capability", lambda: cap)
    assert platforms.current_platform.is_device_capability(asked) is expected
    assert platforms.current_platform.is_device_capability(asked, device_id=0) is expected


def test_stubs_answer_for_this_device() -> None:
    common = sglang_modules.import_peer(sglang_modules.importer(), "sglang.srt.utils.common")
    assert common.is_cuda() == (torch.cuda.is_available() and torch.version.cuda is not None)
    platforms = vllm_modules.import_peer(vllm_modules.importer(), "vllm.platforms")
    assert platforms.current_platform.is_cuda() == is_cuda()
    assert platforms.current_platform.dispatch_key == ("CUDA" if is_cuda() else "CompositeImplicitAutograd")


def test_naive_alignment_blocks_expert_ids_past_e() -> None:
    # docs F1: the CUDA align skips ids outside [0, E) (moe_lora_align_kernel.cu: `expert_id >=
    # num_experts` → continue); SGLang's own sparse-batch fallback gives them blocks of their own.
    runners = sglang_modules.module("runners")
    E, L, block = 2, 1, 64
    topk_ids = torch.tensor([[0], [E]], dtype=I32)  # token 1 routed to a fused shared expert (id E)
    P = -(-(topk_ids.numel() + E * (block - 1)) // block) * block
    _, expert_ids, ntpp = runners._naive_moe_lora_align_block_size(
        topk_ids, torch.tensor([0, 2], dtype=I32), torch.tensor([0], dtype=I32), E, block, L, P, P // block,
        torch.tensor([1], dtype=I32), topk_ids.device)
    assert E in expert_ids.tolist(), "SGLang's naive align no longer blocks ids >= E: update docs F1 and the manifest"
    assert int(ntpp[0]) == 2 * block


def test_naive_alignment_syncs_the_host() -> None:
    # docs F3: the sparse-batch fallback reads its inputs with .cpu().tolist() inside the forward.
    from moelora_core import HostSyncError
    from moelora_core.graphs import host_sync_guard

    runners = sglang_modules.module("runners")
    topk_ids = torch.tensor([[0], [1]], dtype=I32)
    with pytest.raises(HostSyncError), host_sync_guard("cpu"):
        runners._naive_moe_lora_align_block_size(
            topk_ids, torch.tensor([0, 2], dtype=I32), torch.tensor([0], dtype=I32), 2, 64, 1, 192, 3,
            torch.tensor([1], dtype=I32), topk_ids.device)


@pytest.mark.skipif(not (is_cuda() or __import__("os").environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs CUDA or the Triton interpreter")
def test_fused_moe_lora_reads_weights_in_the_output_dtype() -> None:
    # docs F2: _fused_moe_lora_kernel casts the weight pointer to the output's element type.
    runners = sglang_modules.module("runners")
    torch.manual_seed(0)
    L, E, R, H, I = 1, 1, 16, 16, 16  # noqa: E741
    dev = "cuda" if is_cuda() else "cpu"
    a = torch.randn(L, E, 2 * R, H, dtype=torch.float16, device=dev)
    b = torch.randn(L, E, 2 * I, R, dtype=torch.float16, device=dev)
    x = torch.randn(1, H, dtype=torch.float16, device=dev)
    topk = torch.zeros(1, 1, dtype=I32, device=dev)
    info = runners.LoRAInfo(a, b, None, None, torch.tensor([0, 1], dtype=I32, device=dev),
                            torch.tensor([0], dtype=I32, device=dev), torch.tensor([R], dtype=I32, device=dev),
                            torch.tensor([1], dtype=I32, device=dev), torch.tensor([0], dtype=I32, device=dev), R, E)
    P = 64
    align = runners._naive_moe_lora_align_block_size(topk, info.seg_indptr, info.req_to_lora, E, 64, L, P, 1,
                                                     info.adapter_enabled, x.device)
    lora_ids = torch.arange(L, dtype=I32, device=dev)
    expected = torch.cat([b[0, 0, :I].float() @ (a[0, 0, :R].float() @ x[0].float()),
                          b[0, 0, I:].float() @ (a[0, 0, R:].float() @ x[0].float())])
    outs = {}
    for dt in (torch.float16, torch.float32):
        out = torch.zeros(1, 1, 2 * I, dtype=dt, device=dev)
        runners._add_lora_gate_up_delta(x, out, torch.ones(1, 1, device=dev), topk, info, None,
                                        align[0].view(L, -1), align[1].view(L, -1), align[2], lora_ids)
        outs[dt] = out.flatten().float().cpu()
    assert torch.allclose(outs[torch.float16], expected.cpu(), rtol=2e-2, atol=2e-2)
    assert not torch.allclose(outs[torch.float32], expected.cpu(), rtol=2e-2, atol=2e-2), \
        "fused_moe_lora now reads weights in their own dtype: update docs F2 (the adapters' dtype wrap may go)"


def test_peer_files_come_from_one_root() -> None:
    for peer in (sglang_modules, vllm_modules):
        root = peer.importer().dist.root
        assert (Path(root) / peer.importer().dist.name).is_dir()


@pytest.mark.skipif(not (is_cuda() or __import__("os").environ.get("TRITON_INTERPRET") == "1"),
                    reason="needs CUDA or the Triton interpreter")
def test_one_expert_route_keeps_ids_past_e() -> None:
    # docs F4: with one local expert (groups_per_slot == 1) route_bucket_ids folds every nonnegative
    # id into the slot's bucket, so a pair routed to a fused shared expert (id >= E) is aligned as
    # expert 0's and gets its LoRA.
    routing = sglang_modules.import_peer(sglang_modules.importer(), "sglang.kernels.ops.lora.common.routing")
    dev = "cuda" if is_cuda() else "cpu"
    topk_ids = torch.tensor([[0], [1]], dtype=I32, device=dev)  # E = 1: id 1 is past the routed experts
    route = routing.build_route(torch.tensor([0, 0], dtype=I32, device=dev), group_ids=topk_ids, groups_per_slot=1,
                                max_loras=1, block_size=16, view="aligned")
    rows = route.sorted_pair_ids[: int(route.num_pairs_post_padded.reshape(-1)[0])].tolist()
    assert 1 in rows, "SGLang's one-expert route now drops ids >= E: update docs F4 and the grouped manifest"
