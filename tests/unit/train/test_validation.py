"""Stage validation: teacher-forced and student-input losses against a direct computation,
and the best weights a stage keeps."""

from __future__ import annotations

import torch

from distill.replacements.mlp import ResidualMLP
from distill.stages import Stage
from distill.train.losses import layer_loss
from distill.train.modules import StageModule
from distill.train.validation import BestWeights, LayerValidation, Validation
from tests.tiny_teachers import tiny_llama


def test_student_inputs_run_the_earlier_replacements_and_the_stages_own() -> None:
    teacher = tiny_llama(vocab_size=50, num_layers=4)
    heldout_NT = torch.randint(0, 50, (6, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    earlier = {0: ResidualMLP(teacher, 0, output_init_std=0.3).float()}
    blocks = StageModule({layer: ResidualMLP(teacher, layer, output_init_std=0.3).float() for layer in (2, 3)})
    validation = LayerValidation(teacher, Stage(1, (2, 3)), heldout_NT, earlier, batch_size=4,
                                 device=torch.device("cpu"), loss="nmse")
    got = validation(blocks.blocks)

    forced, own = {2: [], 3: []}, {2: [], 3: []}
    with torch.no_grad():
        for batch_BT in heldout_NT.split(4):
            captured = teacher.capture(batch_BT, [2, 3])
            for layer in (2, 3):
                x, y = captured[layer]
                forced[layer].append(layer_loss(blocks.blocks[str(layer)](x), y, "nmse"))
            h1 = earlier[0](teacher.embed(batch_BT))  # layer 0 replaced, layer 1 the teacher's
            h2 = teacher.run_layer(teacher.layers[1], h1)
            out2 = blocks.blocks["2"](h2)
            own[2].append(layer_loss(out2, captured[2][1], "nmse"))
            own[3].append(layer_loss(blocks.blocks["3"](out2), captured[3][1], "nmse"))
    for layer in (2, 3):
        torch.testing.assert_close(got.record["val"][layer], float(torch.stack(forced[layer]).mean()))
        torch.testing.assert_close(got.record["val_student"][layer], float(torch.stack(own[layer]).mean()))
        assert got.record["val_student"][layer] > got.record["val"][layer]  # the earlier errors add up
    assert got.score == (got.record["val_student"][2] + got.record["val_student"][3]) / 2


def test_best_weights_keep_the_lowest_score_and_put_it_back() -> None:
    module = torch.nn.Linear(3, 3)
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    module.register_parameter("frozen", frozen)
    best = BestWeights()
    best.update(module, Validation(None), step=1)  # a rank that does not validate
    assert best.step is None
    best.update(module, Validation(0.5), step=2)
    kept = module.weight.detach().clone()
    with torch.no_grad():
        module.weight.add_(1.0)
    best.update(module, Validation(0.7), step=3)
    best.update(module, Validation(float("nan")), step=4)
    assert (best.step, best.score) == (2, 0.5) and set(best.tensors) == {"weight", "bias"}
    best.restore(module)
    assert torch.equal(module.weight, kept)
    again = BestWeights()
    again.load(best.meta(), best.tensors)
    assert (again.step, again.score) == (2, 0.5)
