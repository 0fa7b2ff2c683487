"""finish_run scores the exported student once: an end-to-end stage that kept its step-0 weights
is the layer stages' student, not a second one to evaluate."""

from __future__ import annotations

import copy

import torch

from distill.model.teacher import Teacher
from distill.replacements.mlp import ResidualMLP
from distill.results.finish import same_student
from tests.tiny_teachers import family_model


def test_a_student_rolled_back_to_its_step_0_weights_is_the_same_student() -> None:
    teacher = Teacher(family_model("llama"))
    replacements = {1: ResidualMLP(teacher, 1, hidden_mult=1.0)}
    rolled_back = copy.deepcopy(replacements)
    assert same_student(teacher, replacements, teacher, rolled_back)
    with torch.no_grad():
        next(rolled_back[1].parameters()).add_(1e-3)
    assert not same_student(teacher, replacements, teacher, rolled_back)
    assert not same_student(teacher, replacements, Teacher(family_model("llama")), copy.deepcopy(replacements))
