"""The exported student through ONNX, as a user exports it: ``torch.onnx.export(..., dynamo=True)``.

A decoder student with every replacement kind (one layer each, beside a kept teacher layer) and
an encoder student of the sequence-mixing kinds are exported once, with dynamic batch and
sequence axes and the attention mask as an input, from a padded example. onnxruntime's output
must equal torch's (1e-4) at other batch sizes and lengths, padded and unpadded: a graph whose
shapes were baked in from the example fails here. Padded positions are left out of the
comparison (their outputs mean nothing; softmax over no key differs between runtimes).
The gated delta rule, whose state crosses chunks through a loop, is refused by name rather than
exported at the example's length. Skipped without the ``onnx`` extra (onnxscript, onnxruntime).

Shape legend: B batch, T tokens, V vocabulary, D hidden size.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

from distill.model.assemble import export_student, load_student
from distill.model.teacher import Teacher
from distill.replacements.gated_delta_rule import GatedDeltaRuleLayer
from distill.replacements.gated_linear_attention import GatedLinearAttentionLayer
from distill.replacements.linear_attention import LinearAttentionLayer
from distill.replacements.lowrank import LowRankLayer
from distill.replacements.mlp import ResidualMLP
from distill.replacements.pruned import PrunedLayer
from distill.replacements.sliding_window_linear import SlidingWindowLinearLayer
from tests.students import nudged, single_thread  # noqa: F401  (single_thread: an autouse fixture)

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

VOCAB = 64
SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
         "initializer_range": 0.2}
CFG = {"_target_": "recorded.only", "_partial_": True}
SHAPES = [(1, 5, False), (3, 17, True), (4, 33, True), (2, 40, False)]
"""(batch, length, left-padded) to check at: none is the example's (2, 9)."""


def _decoder(tmp_path: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    teacher = Teacher(LlamaForCausalLM(LlamaConfig(**SIZES, num_hidden_layers=7, num_key_value_heads=2,
                                                   pad_token_id=0)))
    replacements = nudged({0: LinearAttentionLayer(teacher, 0, chunk_size=4),
                               1: SlidingWindowLinearLayer(teacher, 1, window=3, chunk_size=4),
                               2: GatedLinearAttentionLayer(teacher, 2, gate_init=0.9, chunk_size=4),
                               3: ResidualMLP(teacher, 3, hidden_mult=1.0),
                               4: PrunedLayer(teacher, 4, mlp_keep_fraction=0.5),
                               5: LowRankLayer(teacher, 5, rank_fraction=0.25)})
    export_student(teacher, "tiny", replacements, dict.fromkeys(replacements, CFG), str(tmp_path / "decoder"))
    return load_student(str(tmp_path / "decoder"))


def _encoder(tmp_path: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    teacher = Teacher(BertModel(BertConfig(**SIZES, num_hidden_layers=4, max_position_embeddings=64,
                                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))
    replacements = nudged({0: LinearAttentionLayer(teacher, 0, chunk_size=4),
                               1: SlidingWindowLinearLayer(teacher, 1, window=3, chunk_size=4),
                               2: GatedLinearAttentionLayer(teacher, 2, gate_init=0.9, chunk_size=4)})
    export_student(teacher, "tiny", replacements, dict.fromkeys(replacements, CFG), str(tmp_path / "encoder"))
    return load_student(str(tmp_path / "encoder"))


def _batch(batch: int, length: int, padded: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids_BT = torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask_BT = torch.ones_like(ids_BT)
    if padded:
        mask_BT[0, :4] = 0
    return ids_BT, mask_BT


def _onnx_session(model: torch.nn.Module, extra: dict, path: Path):
    """``torch.onnx.export`` as its documentation shows it, from a padded example of (2, 9)."""
    ids_BT, mask_BT = _batch(2, 9, padded=True, seed=0)
    batch, sequence = torch.export.Dim("batch"), torch.export.Dim("sequence")
    program = torch.onnx.export(
        model, (), kwargs={"input_ids": ids_BT, "attention_mask": mask_BT, **extra}, dynamo=True,
        input_names=["input_ids", "attention_mask"],
        dynamic_shapes={"input_ids": {0: batch, 1: sequence}, "attention_mask": {0: batch, 1: sequence},
                        **dict.fromkeys(extra)},
    )
    program.save(str(path))
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("role", ["decoder", "encoder"])
def test_onnxruntime_equals_torch_at_other_shapes_padded_and_not(role: str, tmp_path: Path) -> None:
    model = _decoder(tmp_path) if role == "decoder" else _encoder(tmp_path)
    extra = {"use_cache": False} if role == "decoder" else {}
    session = _onnx_session(model, extra, tmp_path / f"{role}.onnx")
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask"]
    for seed, (batch, length, padded) in enumerate(SHAPES, start=1):
        ids_BT, mask_BT = _batch(batch, length, padded, seed)
        got = torch.from_numpy(session.run(None, {"input_ids": ids_BT.numpy(), "attention_mask": mask_BT.numpy()})[0])
        with torch.no_grad():
            output = model(input_ids=ids_BT, attention_mask=mask_BT, **extra)
        want = output.logits if role == "decoder" else output.last_hidden_state
        assert got.shape == want.shape
        real = mask_BT.bool()
        torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-4, msg=f"{role} at {(batch, length, padded)}")


def test_the_delta_rule_is_refused_by_name_not_exported_at_one_length(tmp_path: Path) -> None:
    torch.manual_seed(0)
    teacher = Teacher(LlamaForCausalLM(LlamaConfig(**SIZES, num_hidden_layers=2, num_key_value_heads=2,
                                                   pad_token_id=0)))
    replacements = nudged({0: GatedDeltaRuleLayer(teacher, 0, chunk_size=4)})
    export_student(teacher, "tiny", replacements, dict.fromkeys(replacements, CFG), str(tmp_path / "delta"))
    with pytest.raises(Exception, match="gated_delta_rule cannot be exported for inputs of any length"):
        _onnx_session(load_student(str(tmp_path / "delta")), {"use_cache": False}, tmp_path / "delta.onnx")
