"""bench/step_vs_hf.py's pieces (bench/common.py) in-process. The benchmark run at test size on
CPU is in tests/tools/test_bench_step.py."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")


def test_bf16_master_steps_fp32_copies_and_writes_them_back():
    """bench.common.BF16Master (what the DeBERTa bench times as pretrain.py --bf16 trains): the
    model computes in bf16; AdamW steps fp32 masters on the bf16 gradients, exactly as an fp32
    AdamW on the same gradients, and the model gets the masters rounded to bf16."""
    import copy

    import torch

    from bench.common import BF16Master

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    ref = copy.deepcopy(lin)
    opt = BF16Master(lin, torch.optim.AdamW(lin.parameters(), lr=0.1))
    assert lin.weight.dtype == torch.bfloat16 and lin.bias.dtype == torch.bfloat16
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    for _ in range(2):
        lin(torch.randn(5, 4).bfloat16()).float().pow(2).sum().backward()
        for p, r in zip(lin.parameters(), ref.parameters()):
            r.grad = p.grad.float()
        opt.step()
        ref_opt.step()
        for (p, master), r in zip(opt.pairs, ref.parameters()):
            assert master.dtype == torch.float32 and torch.equal(master, r.detach())
            assert torch.equal(p.detach(), r.detach().bfloat16())
        opt.zero_grad()
        assert all(p.grad is None and m.grad is None for p, m in opt.pairs)
    assert not torch.equal(ref.weight, copy.deepcopy(lin).float().weight)  # bf16 rounding shows
