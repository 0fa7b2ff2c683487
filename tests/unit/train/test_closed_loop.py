"""Closed-loop inputs: built by running the student's own layers from the embeddings."""

from __future__ import annotations

import pytest
import torch

from distill.replacements.mlp import ResidualMLP
from distill.stages import Stage
from distill.train.closed_loop import ClosedLoopInputs, run_student_layers, student_fraction
from tests.tiny_teachers import tiny_llama


def test_student_inputs_chain_replacements_and_teacher_layers() -> None:
    teacher = tiny_llama(vocab_size=50, num_layers=4)
    ids_BT = torch.randint(0, 50, (2, 8))
    embed_BTD = teacher.embed(ids_BT)
    r0, r2 = ResidualMLP(teacher, 0).float(), ResidualMLP(teacher, 2).float()
    got = run_student_layers(teacher, embed_BTD, (1, 3), {0: r0, 2: r2})
    with torch.no_grad():
        h1 = r0(embed_BTD)
        h3 = r2(teacher.run_layer(teacher.layers[1], h1))
    assert set(got) == {1, 3}
    torch.testing.assert_close(got[1], h1)
    torch.testing.assert_close(got[3], h3)
    # with no replacement at all, the inputs are the teacher's own
    captured = teacher.capture(ids_BT, [0, 3])
    torch.testing.assert_close(run_student_layers(teacher, embed_BTD, (0, 3), {})[3], captured[3][0])


def test_schedules() -> None:
    assert student_fraction("teacher", 5, 10) == 0.0
    assert student_fraction("student", 0, 10) == 1.0
    assert [student_fraction("mix", s, 5) for s in range(5)] == [0.0, 0.25, 0.5, 0.75, 1.0]
    with pytest.raises(ValueError, match="student.inputs"):
        student_fraction("both", 0, 10)


def test_mix_ramps_from_teacher_to_student_inputs_per_sample() -> None:
    teacher = tiny_llama(vocab_size=50, num_layers=2)
    ids_BT = torch.randint(0, 50, (64, 4))
    stage = Stage(1, (1,), closed_loop=True)
    captured = teacher.capture(ids_BT, [0, 1])
    hidden_BPTD = torch.stack([captured[0][0], captured[1][0], captured[1][1]], dim=1)  # positions 0, 1, 2
    teacher_inputs = {1: hidden_BPTD[:, 1]}
    frozen = {0: ResidualMLP(teacher, 0).float()}
    loop = ClosedLoopInputs(teacher, stage, frozen, "mix", total_steps=3, grad_accum_steps=1, start_step=0, seed=0)
    with torch.no_grad():
        student_B = frozen[0](hidden_BPTD[:, 0])
    shares = []
    for _ in range(3):
        got = loop(hidden_BPTD, teacher_inputs, {})[1]
        from_student = (got - student_B).abs().flatten(1).amax(1) == 0
        from_teacher = (got - teacher_inputs[1]).abs().flatten(1).amax(1) == 0
        assert bool((from_student | from_teacher).all())
        shares.append(float(from_student.float().mean()))
    assert shares[0] == 0.0 and 0.2 < shares[1] < 0.8 and shares[2] == 1.0
    resumed = ClosedLoopInputs(teacher, stage, frozen, "mix", total_steps=3, grad_accum_steps=1, start_step=2,
                               seed=0)
    torch.testing.assert_close(resumed(hidden_BPTD, teacher_inputs, {})[1], student_B)


def test_worker_sends_the_embeddings_for_a_closed_loop_stage() -> None:
    from distill.model.data import sample_indices
    from distill.pipeline.slot import HEADER_BYTES, slot_stride
    from distill.pipeline.worker import SlotTarget
    from distill.stages import sample_batch_config
    from distill.teacher.targets import TeacherTargets

    teacher = tiny_llama(vocab_size=50, num_layers=3)
    train_NT = torch.randint(0, 50, (10, 8))
    stage = Stage(0, (2,), closed_loop=True)
    config = sample_batch_config(len(stage.positions), 8, 32, "float32")
    stride = slot_stride(config.nbytes())
    buf = bytearray(2 * stride)
    views = [memoryview(buf)[i * stride + HEADER_BYTES:][:config.nbytes()] for i in range(2)]
    TeacherTargets(teacher, train_NT, seed=0)(stage.model_id, stage.model_cfg,
                                                [SlotTarget(i, 1, v, config.decode(v)) for i, v in enumerate(views)])
    rows = sample_indices(10, [0, 1], 0)
    captured = teacher.capture(train_NT[rows], [0, 2])
    for i, view in enumerate(views):
        hidden_PTD = config.decode(view)["hidden"]
        torch.testing.assert_close(hidden_PTD[0], teacher.embed(train_NT[rows[i]][None])[0])
        torch.testing.assert_close(hidden_PTD[stage.io_index(2)[0]], captured[2][0][i])
        torch.testing.assert_close(hidden_PTD[stage.io_index(2)[1]], captured[2][1][i])
