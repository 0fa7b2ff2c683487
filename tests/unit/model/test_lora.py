"""LoRA adapters: start as the identity update, train only A and B, merge exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distill.model.lora import LoRALinear, add_lora, merge_lora


def test_lora_starts_at_the_base_map_and_trains_only_the_adapters() -> None:
    torch.manual_seed(0)
    base = nn.Linear(6, 4)
    lora = LoRALinear(base, rank=2, alpha=4.0)
    x_NI = torch.randn(5, 6)
    torch.testing.assert_close(lora(x_NI), base(x_NI))
    lora(x_NI).pow(2).sum().backward()
    assert base.weight.grad is None and base.bias.grad is None
    assert lora.lora_B.grad.abs().sum() > 0  # B gets gradients first (A's are zero while B = 0)
    with pytest.raises(ValueError, match="lora_rank"):
        LoRALinear(nn.Linear(2, 2), rank=0, alpha=1.0)


def test_merged_linear_computes_the_adapted_map() -> None:
    torch.manual_seed(0)
    lora = LoRALinear(nn.Linear(6, 4), rank=3, alpha=6.0)
    with torch.no_grad():
        lora.lora_B.normal_()
    x_NI = torch.randn(5, 6)
    merged = lora.merged()
    assert type(merged) is nn.Linear and merged.weight.requires_grad
    torch.testing.assert_close(merged(x_NI), lora(x_NI), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(merged(x_NI), lora.base(x_NI))


def test_add_and_merge_lora_on_a_module_tree() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Sequential(nn.GELU(), nn.Linear(8, 4)))
    x_NI = torch.randn(3, 4)
    before = model(x_NI)
    assert add_lora(model, rank=2, alpha=2.0) == 2
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"0.lora_A", "0.lora_B", "2.1.lora_A", "2.1.lora_B"}  # LayerNorm frozen too
    torch.testing.assert_close(model(x_NI), before)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.uniform_(-0.5, 0.5)
    adapted = model(x_NI)
    assert merge_lora(model) == 2
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    torch.testing.assert_close(model(x_NI), adapted, rtol=1e-5, atol=1e-6)
    assert set(model.state_dict()) == {"0.weight", "0.bias", "1.weight", "1.bias", "2.1.weight", "2.1.bias"}
