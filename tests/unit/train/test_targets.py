"""The teacher worker's batch function writes exactly the captured boundary states.

A GPU variant runs the same check with the teacher on CUDA (device-to-host copies
straight into the slot views) when CUDA is present.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from distill.model.data import sample_indices
from distill.model.teacher import Teacher
from distill.pipeline.slot import HEADER_BYTES, slot_stride
from distill.pipeline.worker import SlotTarget
from distill.train.stages import Stage, sample_batch_config
from distill.train.targets import TeacherTargets

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layers", [(0,), (1, 2), (0, 2)])
def test_batch_fn_writes_boundary_states_into_slots(device: str, layers: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2))
    teacher = Teacher(model, device=device)
    train_NT = torch.randint(0, 64, (20, 8))
    stage = Stage(0, layers)
    config = sample_batch_config(4, 8, 32, "float32")
    buf = bytearray(3 * slot_stride(config.nbytes()))
    views = [memoryview(buf)[i * slot_stride(config.nbytes()) + HEADER_BYTES:][:config.nbytes()] for i in range(3)]
    request_ids = [11, 12, 13]
    targets = [SlotTarget(rid, 1, view, config.decode(view)) for rid, view in zip(request_ids, views, strict=True)]
    finish = TeacherTargets(teacher, train_NT, seed=0)(stage.model_id, stage.model_cfg, targets)
    assert (finish is None) == (device == "cpu")  # on CUDA the copies are left in flight
    if finish is not None:
        finish()
    rows = sample_indices(20, request_ids, 0)
    captured = teacher.capture(train_NT[rows], list(layers))
    for i, view in enumerate(views):
        sample = config.decode(view)
        assert torch.equal(sample["input_ids"], train_NT[rows[i]])
        for layer in layers:
            x_idx, y_idx = stage.io_index(layer)
            torch.testing.assert_close(sample["hidden"][x_idx], captured[layer][0][i].cpu())
            torch.testing.assert_close(sample["hidden"][y_idx], captured[layer][1][i].cpu())


def test_the_student_seed_changes_the_sample_order_and_seed_0_keeps_the_data_seeds() -> None:
    from omegaconf import OmegaConf

    from distill.model.data import sample_indices
    from distill.train.targets import sample_seed

    def order(data_seed: int, student_seed: int) -> list[int]:
        cfg = OmegaConf.create({"data": {"seed": data_seed}, "student": {"seed": student_seed}})
        return sample_indices(1000, list(range(20)), sample_seed(cfg))

    assert order(3, 0) == sample_indices(1000, list(range(20)), 3)
    assert order(0, 1) != order(0, 0) != order(0, 2) and order(0, 1) != order(0, 2)
