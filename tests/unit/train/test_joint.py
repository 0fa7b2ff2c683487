"""The joint schedule: every layer trained from one pass of the chain the student runs itself."""

from __future__ import annotations

import pytest
import torch

from distill.replacements.mlp import ResidualMLP
from distill.stages import Stage, layer_stages, stage_layout
from distill.train.joint import ChainStep, JointTraining, JointValidation, run_chain
from distill.train.losses import layer_loss
from distill.train.validation import LayerValidation
from tests.tiny_teachers import tiny_bert, tiny_llama
from tests.unit.test_config import _compose


def _blocks(teacher, layers) -> dict[str, torch.nn.Module]:
    torch.manual_seed(1)
    return {str(layer): ResidualMLP(teacher, layer).float() for layer in layers}


@pytest.mark.parametrize("make", [tiny_llama, tiny_bert])
def test_teacher_inputs_are_exactly_the_teachers_own_inputs_and_outputs(make) -> None:
    """With teacher inputs the chain hands every layer what HF's own forward gives and makes of it."""
    teacher = make(vocab_size=50, num_layers=4)
    ids_BT = torch.randint(0, 50, (2, 8))
    captured = teacher.capture(ids_BT, [0, 1, 2, 3])
    blocks = _blocks(teacher, (0, 2, 3))
    seen: dict[int, ChainStep] = {}

    def on_step(step: ChainStep) -> torch.Tensor:
        seen[step.layer] = step
        return blocks[str(step.layer)](step.input_BTD)

    run_chain(teacher, (0, 2, 3), teacher.embed(ids_BT), blocks, None, on_step)
    assert sorted(seen) == [0, 2, 3]
    for layer, step in seen.items():
        torch.testing.assert_close(step.input_BTD, captured[layer][0].float(), atol=1e-5, rtol=0)
        torch.testing.assert_close(step.target_BTD, captured[layer][1].float(), atol=1e-5, rtol=0)


def test_student_inputs_chain_the_replacements_and_targets_are_the_teacher_layer_on_them() -> None:
    teacher = tiny_llama(vocab_size=50, num_layers=4)
    ids_BT = torch.randint(0, 50, (3, 8))
    blocks = _blocks(teacher, (0, 2))
    seen: dict[int, ChainStep] = {}

    def on_step(step: ChainStep) -> torch.Tensor:
        seen[step.layer] = step
        return blocks[str(step.layer)](step.input_BTD)

    embed_BTD = teacher.embed(ids_BT)
    run_chain(teacher, (0, 2), embed_BTD, blocks, torch.ones(3, dtype=torch.bool), on_step)
    with torch.no_grad():
        h1 = blocks["0"](embed_BTD)
        h2 = teacher.run_layer(teacher.layers[1], h1, 1)
    torch.testing.assert_close(seen[2].input_BTD, h2)
    torch.testing.assert_close(seen[2].target_BTD, teacher.run_layer(teacher.layers[2], h2, 2).detach())
    assert 3 not in seen  # the chain stops at the last trained layer


def test_each_replacement_gets_the_gradient_of_its_own_loss_alone() -> None:
    """Per-layer backward inside the chain = each layer trained alone on its input and target."""
    teacher = tiny_llama(vocab_size=50, num_layers=3)
    ids_BT = torch.randint(0, 50, (2, 8))
    stage = Stage(0, (0, 1, 2), closed_loop=True, joint=True)
    blocks = _blocks(teacher, stage.layers)
    joint = JointTraining(teacher, stage, "student", "nmse", total_steps=4, grad_accum_steps=2, start_step=0, seed=0)
    losses = joint(teacher.embed(ids_BT), blocks)
    assert sorted(losses) == [0, 1, 2]
    grads = {name: [p.grad.clone() for p in block.parameters()] for name, block in blocks.items()}
    hidden_BTD = teacher.embed(ids_BT).float()
    for layer in stage.layers:
        block = blocks[str(layer)]
        block.zero_grad()
        with torch.no_grad():
            target_BTD = teacher.run_layer(teacher.layers[layer], hidden_BTD, layer)
        pred_BTD = block(hidden_BTD)
        alone = layer_loss(pred_BTD, target_BTD, "nmse")
        (alone / 2).backward()  # accumulation over 2 micro-batches scales by 1/2
        assert float(alone.detach()) == pytest.approx(losses[layer], rel=1e-5)
        for got, want in zip(grads[str(layer)], block.parameters(), strict=True):
            torch.testing.assert_close(got, want.grad)
        hidden_BTD = pred_BTD.detach()


def test_joint_validation_agrees_with_the_cached_layer_validation() -> None:
    teacher = tiny_llama(vocab_size=50, num_layers=3)
    heldout_NT = torch.randint(0, 50, (5, 8))
    stage = Stage(0, (0, 1, 2), closed_loop=True, joint=True)
    blocks = _blocks(teacher, stage.layers)
    joint = JointValidation(teacher, stage, heldout_NT, 2, torch.device("cpu"), "nmse")(blocks)
    cached = LayerValidation(teacher, stage, heldout_NT, {}, 2, torch.device("cpu"), "nmse")(blocks)
    for key in ("val", "val_student"):
        for layer in stage.layers:
            assert joint.record[key][layer] == pytest.approx(cached.record[key][layer], rel=1e-5)
    assert joint.score == pytest.approx(cached.score, rel=1e-5)


def test_a_joint_schedule_is_one_stage_whose_samples_carry_the_embeddings_only() -> None:
    cfg = _compose(["student.schedule=joint", "student.layers_per_stage=2", "data.seq_len=16"])
    stages, batch_config = stage_layout(cfg, num_layers=5, hidden_size=8)
    assert [(s.layers, s.joint, s.positions) for s in stages] == [((0, 1, 2, 3, 4), True, (0,))]
    (hidden,) = [spec.shape for spec in batch_config.specs if spec.name == "hidden"]
    assert tuple(hidden) == (1, 16, 8)
    assert Stage.from_model_cfg(stages[0].model_cfg) == stages[0]
    assert stages[0].captured_layers == [0]
    chosen = layer_stages(cfg, 6, [1, 4], first_index=3)  # a hybrid's choice: teacher layers in between
    assert [(s.index, s.layers, s.joint) for s in chosen] == [(3, (1, 4), True)]
