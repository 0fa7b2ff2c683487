"""Activation checkpointing on the exported student, as a user fine-tuning it turns it on.

A mixed student (every replacement kind beside a kept teacher layer) of a Llama and of a BERT
teacher is loaded back and trained one step with and one step without
``activation_checkpointing_enable()``: the gradients must agree to 1e-5, and the replaced
layers must really be replayed in the backward (each runs twice), so a switch that silently
does nothing fails. ``Trainer(gradient_checkpointing=True)`` then trains two steps.

Shape legend: B batch, T tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (
    BertConfig,
    BertModel,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
)

from distill.model.assemble import export_student, load_student
from distill.model.teacher import Teacher
from distill.replacements.gated_linear_attention import GatedLinearAttentionLayer
from distill.replacements.linear_attention import LinearAttentionLayer
from distill.replacements.mlp import ResidualMLP
from distill.replacements.pruned import PrunedLayer
from distill.replacements.sliding_window_linear import SlidingWindowLinearLayer
from tests.students import nudged, single_thread  # noqa: F401  (single_thread: an autouse fixture)

VOCAB = 64
SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
         "num_attention_heads": 4, "initializer_range": 0.2}
CFG = {"_target_": "recorded.only", "_partial_": True}


def _teacher(family: str) -> Teacher:
    torch.manual_seed(0)
    if family == "llama":
        return Teacher(LlamaForCausalLM(LlamaConfig(**SIZES, num_key_value_heads=2, pad_token_id=0)))
    return Teacher(BertModel(BertConfig(**SIZES, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)))


def _mixed_student(family: str, tmp_path: Path) -> torch.nn.Module:
    """Layers 0-4 replaced (linear, sliding window, gated, token-wise, pruned); layer 5 the teacher's."""
    teacher = _teacher(family)
    replacements = {0: LinearAttentionLayer(teacher, 0, chunk_size=4),
                    1: SlidingWindowLinearLayer(teacher, 1, window=3, chunk_size=4),
                    2: GatedLinearAttentionLayer(teacher, 2, gate_init=0.9, chunk_size=4),
                    3: ResidualMLP(teacher, 3, hidden_mult=1.0),
                    4: PrunedLayer(teacher, 4, mlp_keep_fraction=0.5)}
    nudged(replacements)
    out = tmp_path / family
    export_student(teacher, "tiny", replacements, dict.fromkeys(replacements, CFG), str(out))
    model = load_student(str(out))
    model.requires_grad_(True)
    return model.train()


def _loss(model: torch.nn.Module, ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    output = model(ids_BT, attention_mask=mask_BT)
    logits = output.logits if hasattr(output, "logits") else output.last_hidden_state
    return logits.float().square().mean() if not hasattr(output, "logits") else torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), ids_BT[:, 1:].flatten())


def _grads(model: torch.nn.Module, ids_BT: torch.Tensor, mask_BT: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _loss(model, ids_BT, mask_BT).backward()
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.grad is not None}


def _count_calls(model: torch.nn.Module) -> dict[str, int]:
    """Calls of each layer's first submodule: inside the layer's ``forward``, so a checkpoint's
    replay counts (hooks on the layer itself stay outside the checkpoint)."""
    layers = model.model.layers if hasattr(model, "model") else model.encoder.layer
    counts: dict[str, int] = {}
    for idx, layer in enumerate(layers):
        inner = getattr(layer, "layer", layer)  # kinds copy/pruned/lowrank: the teacher-class layer inside

        def hook(*_: object, key: str = f"{idx}:{type(layer).__name__}") -> None:
            counts[key] = counts.get(key, 0) + 1
        next(inner.children()).register_forward_pre_hook(hook)
    return counts


@pytest.mark.parametrize("family", ["llama", "bert"])
def test_checkpointed_gradients_equal_plain_ones_and_layers_are_replayed(family: str, tmp_path: Path) -> None:
    model = _mixed_student(family, tmp_path)
    ids_BT = torch.randint(1, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    mask_BT = torch.ones_like(ids_BT)
    mask_BT[1, -3:] = 0  # a padded row: the masks must survive the replay
    counts = _count_calls(model)
    plain = _grads(model, ids_BT, mask_BT)
    assert set(counts.values()) == {1}
    counts.clear()
    model.activation_checkpointing_enable()
    checkpointed = _grads(model, ids_BT, mask_BT)
    assert set(counts.values()) == {2}, counts  # every layer, replaced ones included, ran again in backward
    assert plain.keys() == checkpointed.keys() and len(plain) > 20
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=0, atol=1e-5, msg=name)
    model.activation_checkpointing_disable()
    counts.clear()
    _grads(model, ids_BT, mask_BT)
    assert set(counts.values()) == {1}


def test_a_checkpointed_decoder_drops_its_cache_in_training_and_keeps_it_in_generation(tmp_path: Path) -> None:
    """A cache would take each replaced layer's state twice (forward and replay): training runs
    without one, as transformers' own models do; generation (no gradients) keeps it."""
    model = _mixed_student("llama", tmp_path)
    model.activation_checkpointing_enable()
    ids_BT = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(2))
    assert model(ids_BT, use_cache=True).cache is None
    model.eval()
    with torch.no_grad():
        assert model(ids_BT, use_cache=True).cache is not None
    model.train()
    generated = model.generate(ids_BT, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 11)


def test_trainer_trains_two_steps_with_gradient_checkpointing(tmp_path: Path) -> None:
    model = _mixed_student("llama", tmp_path)
    before = {name: param.detach().clone() for name, param in model.named_parameters()}
    rows = torch.randint(1, VOCAB, (8, 12), generator=torch.Generator().manual_seed(3))
    dataset = [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in rows]
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), gradient_checkpointing=True, max_steps=2,
                             per_device_train_batch_size=4, learning_rate=1e-2, report_to=[], use_cpu=True,
                             save_strategy="no", logging_steps=1, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=dataset)
    result = trainer.train()
    assert result.global_step == 2 and torch.isfinite(torch.tensor(result.training_loss))
    assert model.model.layers[0].gradient_checkpointing  # Trainer turned it on, on our layers too
    changed = [name for name, param in model.named_parameters() if not torch.equal(param.detach(), before[name])]
    assert any(".attention." in name for name in changed)  # a replaced layer's own weights trained
