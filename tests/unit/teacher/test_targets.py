"""The teacher worker's batch function writes exactly the captured boundary states.

A GPU variant runs the same check with the teacher on CUDA (device-to-host copies
straight into the slot views) when CUDA is present. A teacher placed by a transformers
device map (how a worker holds a teacher larger than one GPU) goes through the same
path: over the CPU here, over real CUDA devices in its ``gpu`` variant.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from distill.model.data import sample_indices
from distill.model.teacher import Teacher, teacher_device_map
from distill.pipeline.slot import HEADER_BYTES, slot_stride
from distill.pipeline.worker import SlotTarget
from distill.stages import Stage, sample_batch_config
from distill.teacher.targets import SleepingTeacher, TeacherTargets, write_e2e_targets

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
    from distill.teacher.targets import sample_seed

    def order(data_seed: int, student_seed: int) -> list[int]:
        cfg = OmegaConf.create({"data": {"seed": data_seed}, "student": {"seed": student_seed}})
        return sample_indices(1000, list(range(20)), sample_seed(cfg))

    assert order(3, 0) == sample_indices(1000, list(range(20)), 3)
    assert order(0, 1) != order(0, 0) != order(0, 2) and order(0, 1) != order(0, 2)


def _spread(num_gpus: int) -> tuple[list, dict | None]:
    """Devices (and budgets) that split the tiny teacher: 2 GPUs, or 1 GPU and the CPU."""
    if num_gpus >= 2:
        return [0, 1], None
    return [0, "cpu"], {0: 100_000}  # the embeddings and a layer or two: the rest offloaded to the CPU


MAPS = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("where", MAPS)
def test_teacher_on_a_device_map_fills_slots_like_one_on_one_device(where: str, tmp_path) -> None:
    """device_map path (worker_gpus): the model is placed by transformers, not moved; capture
    still stops after the stage's last layer; the slots get what a plain teacher gives."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2))
    model.save_pretrained(tmp_path)
    plain = Teacher(model)
    devices, budget = (["cpu"], None) if where == "cpu" else _spread(torch.cuda.device_count())
    placement = teacher_device_map(devices, budget)
    assert placement["device_map"] == "balanced" and set(placement["max_memory"]) == set(devices)
    spread = Teacher.from_pretrained(str(tmp_path), **placement)
    if where == "cuda":
        assert len(set(spread.model.hf_device_map.values())) >= 2, spread.model.hf_device_map
    ran: list[int] = []
    for idx, layer in enumerate(spread.layers):
        layer.register_forward_pre_hook(lambda *_, idx=idx: ran.append(idx))

    train_NT = torch.randint(0, 64, (20, 8))
    stage = Stage(0, (1,))
    config = sample_batch_config(2, 8, 32, "float32", top_k=5)
    stride = slot_stride(config.nbytes())
    buf = bytearray(3 * stride)
    views = [memoryview(buf)[i * stride + HEADER_BYTES:][:config.nbytes()] for i in range(3)]
    targets = [SlotTarget(rid, 1, view, config.decode(view)) for rid, view in zip([4, 5, 6], views, strict=True)]
    finish = TeacherTargets(spread, train_NT, seed=0)(stage.model_id, stage.model_cfg, targets)
    if finish is not None:
        finish()
    assert ran == [0, 1]  # layers 2, 3 never ran
    rows = sample_indices(20, [4, 5, 6], 0)
    want = plain.capture(train_NT[rows], [1])[1]
    for i, view in enumerate(views):
        torch.testing.assert_close(config.decode(view)["hidden"][0], want[0][i], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(config.decode(view)["hidden"][1], want[1][i], rtol=1e-4, atol=1e-5)

    write_e2e_targets(spread, train_NT[rows], targets)  # the full forward and the head, spread too
    with torch.no_grad():
        logp_BTK = torch.log_softmax(plain.model(train_NT[rows]).logits, -1).topk(5, dim=-1).values
    for i, view in enumerate(views):
        torch.testing.assert_close(config.decode(view)["topk_logp"], logp_BTK[i], rtol=1e-4, atol=1e-4)


def test_the_sleeping_teacher_takes_at_least_its_time_and_keeps_the_teachers_samples() -> None:
    """teacher.sleep_per_batch_s: a batch takes at least that long, the forward's own time
    included (a forward slower than it is not slowed further), and what the wrapped batch
    function wrote and returned comes through unchanged."""
    calls = []

    def fill(model_id: str, model_cfg: dict | None, targets: list) -> object:
        time.sleep(forward_s)
        calls.append((model_id, model_cfg, targets))
        return "finish"

    for forward_s, batch_s, least, most in [(0.0, 0.05, 0.05, 0.09), (0.03, 0.05, 0.05, 0.09),
                                            (0.08, 0.02, 0.08, 0.12)]:
        started = time.perf_counter()
        assert SleepingTeacher(fill, batch_s)("m", {"layers": [0]}, ["t"]) == "finish"
        took = time.perf_counter() - started
        assert least <= took < most, (forward_s, batch_s, took)
    assert calls == [("m", {"layers": [0]}, ["t"])] * 3
