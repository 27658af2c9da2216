"""GPU: readers' output loaded into CUDA pools (bf16 and fp32) holds exactly the cast factors.

The readers return CPU tensors; load_adapter_into_slot copies them into device pools. Skipped
without CUDA (run on the H200 by ci/gpu).
"""

import pytest
import torch

from moelora_core import LoRAWeights
from moelora_core.checkpoint import MoEModelConfig, load_adapter_into_slot, read_adapter
from moelora_core.checkpoint.synthetic import adapter_tensors, model_config_dict, write_adapter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapter_into_cuda_pools(tmp_path, dtype):
    cfg = MoEModelConfig.from_dict(model_config_dict("qwen3_moe", hidden=64, inter=32, experts=8, top_k=2,
                                                     heads=4, kv_heads=2, head_dim=16, layers=2))
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(8, 4, 64, generator=gen)
    layer = {"gate": (a, torch.randn(8, 32, 4, generator=gen)), "up": (a.clone(), torch.randn(8, 32, 4, generator=gen)),
             "down": (torch.randn(8, 4, 32, generator=gen), torch.randn(8, 64, 4, generator=gen)),
             "q": (torch.randn(4, 64, generator=gen), torch.randn(64, 4, generator=gen))}
    tensors, targets = adapter_tensors(cfg, {0: layer, 1: layer})
    path = write_adapter(tmp_path / "ad", tensors, {**targets, "r": 4, "lora_alpha": 8}, dtype=torch.bfloat16)
    adapter = read_adapter(path, cfg, dtype=dtype, max_rank=16)
    pools = [LoRAWeights(cfg.layer_spec(max_loras=4, max_rank=16, dtype=dtype, device="cuda")) for _ in range(2)]
    load_adapter_into_slot(pools, 3, adapter)
    torch.cuda.synchronize()
    for pool in pools:
        for m, (A, B) in layer.items():
            pa, pb = pool.factors(m)
            assert torch.equal(pa[3, ..., :4, :].cpu(), A.to(torch.bfloat16).to(dtype))
            assert torch.equal(pb[3, ..., :, :4].cpu(), B.to(torch.bfloat16).to(dtype))
            assert pool.scalings(m)[3].item() == 2.0 and pool.ranks(m)[3].item() == 4
