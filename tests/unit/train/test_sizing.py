"""The sizing formulas (docs/scale.md) against what the code allocates and counts: the sample
layout the workers write, the shared-memory segment a student really creates, the parameters
of a real HF model; and the start-up check that refuses a run they say cannot fit."""

from __future__ import annotations

import os

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from distill.pipeline.mediums.shm import SharedMemoryManager
from distill.pipeline.slot import slot_stride
from distill.stages import max_positions, stage_layout
from distill.train.sizing import (
    ModelShape,
    disk_bytes,
    e2e_rank_floor,
    sample_bytes,
    segment_bytes,
    shm_bytes,
    state_bytes_per_token,
)
from tests.unit.test_config import _compose

LLAMA_70B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
             "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
             "intermediate_size": 28672, "tie_word_embeddings": False}


@pytest.mark.parametrize("overrides", [
    [], ["student.layers_per_stage=3"], ["student.inputs=student"], ["teacher.dtype=bfloat16", "data.seq_len=64"],
    ["student.e2e.steps=5", "student.e2e.top_k=16"],
])
def test_sample_bytes_is_the_layout_workers_write(overrides: list[str]) -> None:
    cfg = _compose(["mode=student", *overrides])
    tiny = cfg.teacher.tiny
    stages, batch_config = stage_layout(cfg, tiny.num_layers, tiny.hidden_size)
    top_k = cfg.student.e2e.top_k if cfg.student.e2e.steps > 0 else 0
    want = sample_bytes(cfg.data.seq_len, tiny.hidden_size, cfg.teacher.dtype, max_positions(stages), top_k)
    assert batch_config.nbytes() == want


def test_shm_bytes_is_the_segment_a_student_creates() -> None:
    """The formula against the size of a real segment in /dev/shm (bench/scale.py checks the
    whole of a run's: the dataset's segment and the control client's one slot)."""
    cfg = _compose(["mode=student", "teacher.dtype=bfloat16", "pipeline.slot_count=5"])
    stages, batch_config = stage_layout(cfg, 4, 128)
    with SharedMemoryManager(cfg.pipeline.slot_count, slot_stride(batch_config.nbytes())) as segment:
        measured = os.stat(f"/dev/shm/{segment.buf_name}").st_size
    assert measured == segment_bytes(batch_config.nbytes(), cfg.pipeline.slot_count)
    assert shm_bytes(1000, 4, loader_workers=3, ranks=2) == 2 * (3 * (4 * slot_stride(1000) + 64) + slot_stride(1000) + 64)


def test_parameter_count_of_a_real_model() -> None:
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    shape = ModelShape.from_config(config.to_dict())
    assert shape.params == sum(p.numel() for p in model.parameters()) - norms
    assert 70.5e9 < ModelShape.from_config(LLAMA_70B).params < 70.6e9


def test_state_disk_and_floor_formulas() -> None:
    assert state_bytes_per_token(8192, "bfloat16") == 16384
    assert disk_bytes(10, 8192, "bfloat16", 80) == 10 * 81 * 16384
    shape = ModelShape.from_config(LLAMA_70B)
    ddp = e2e_rank_floor(shape, "bfloat16", "all", 8, sharded=False, loss_chunk_tokens=1024)
    fsdp = e2e_rank_floor(shape, "bfloat16", "all", 8, sharded=True, loss_chunk_tokens=1024)
    assert fsdp["trained copy, gradients, AdamW"] * 8 == ddp["trained copy, gradients, AdamW"] == shape.params * 16
    assert set(e2e_rank_floor(shape, "bfloat16", "replacements", 8, True, 1024)) == {"teacher", "loss chunks"}
