"""The stage trainer against a real broker and a real teacher worker (threads of this process):
a stage trains, validates, checkpoints, resumes at its checkpoint, stops on patience, and
records itself; its loss is the reference formula."""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from distill.config import Config
from distill.pipeline import Broker, Worker
from distill.pipeline.mediums.shm import list_segments
from distill.replacements.teacher_copy import TeacherCopy
from distill.stages import stage_layout
from distill.teacher.targets import TeacherTargets
from distill.train import checkpoint as ckpt
from distill.train.context import METRICS_FILE, StudentContext
from distill.train.layer_stage import LayerTask
from distill.train.losses import layer_loss
from distill.train.modules import StageModule
from distill.train.trainer import StageTrainer, cosine_lr, train_stage
from distill.train.validation import Validation
from distill.transport import broker_kwargs, control_client, worker_kwargs
from tests.tiny_teachers import tiny_llama
from tests.unit.test_config import _config

SEQ_LEN = 16
VOCAB = 96


def _cfg(tmp_path: Path, *overrides: str, replacement: str = "mlp") -> Config:
    socket_dir = tmp_path / "sock"
    socket_dir.mkdir(mode=0o700, exist_ok=True)
    return _config(["mode=student", f"replacement={replacement}", f"data.seq_len={SEQ_LEN}", "student.micro_batch_size=4",
                     "student.steps_per_stage=6", "student.checkpoint_every_steps=3", "student.log_every_steps=1",
                     "student.lr=1e-2", "pipeline.slot_count=8", "pipeline.worker_max_batch=4",
                     "pipeline.heartbeat_interval_s=0.2", f"pipeline.socket_dir={socket_dir}",
                     f"checkpoint_dir={tmp_path / 'ckpt'}", "run_id=trainertest", "student.inputs=teacher",
                     "student.e2e.steps=0", *overrides])


@pytest.fixture
def pipeline_for(tmp_path: Path) -> Iterator:
    """Starts a broker and one teacher worker for a config; stops them after the test."""
    started: list = []

    def start(cfg: Config, teacher) -> None:
        _, batch_config = stage_layout(cfg, teacher.num_layers, teacher.hidden_size)
        train_NT = torch.randint(0, VOCAB, (64, SEQ_LEN), generator=torch.Generator().manual_seed(0))
        broker = Broker(**broker_kwargs(cfg)).start()
        worker = Worker(batch_fn=TeacherTargets(teacher, train_NT, seed=0), batch_config=batch_config,
                        **worker_kwargs(cfg)).start()
        started.extend([worker, broker])

    yield start
    for part in started:
        part.stop()


def _context(cfg: Config, teacher, out_dir: Path) -> StudentContext:
    stages, batch_config = stage_layout(cfg, teacher.num_layers, teacher.hidden_size)
    client = control_client(cfg, 0, batch_config)
    client.hello()
    heldout_NT = torch.randint(0, VOCAB, (8, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    out_dir.mkdir(exist_ok=True)
    return StudentContext(cfg, 0, 1, torch.device("cpu"), teacher, client, batch_config, heldout_NT,
                          Path(cfg.checkpoint_dir), out_dir, stages, teacher.name_or_path)


def _events(out_dir: Path, event: str) -> list[dict]:
    lines = (out_dir / METRICS_FILE).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


def test_a_stage_trains_validates_checkpoints_and_records_itself(tmp_path: Path, pipeline_for) -> None:
    cfg = _cfg(tmp_path, "student.val_every_steps=2", "student.layers=[1]")
    teacher = tiny_llama(VOCAB, 2)
    pipeline_for(cfg, teacher)
    ctx = _context(cfg, teacher, tmp_path / "run")
    try:
        trainer = StageTrainer(ctx, LayerTask(ctx, ctx.stages[0]))
        train_stage(trainer)
    finally:
        ctx.client.close()
    train = _events(ctx.out_dir, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6] and all(r["layers"] == [1] for r in train)
    assert all(math.isfinite(r["loss"]) and r["samples_per_s"] > 0 for r in train)
    vals = _events(ctx.out_dir, "val")
    assert [r["step"] for r in vals] == [2, 4, 6] and vals[-1]["layer_losses"]["1"] < vals[0]["layer_losses"]["1"]
    (end,) = _events(ctx.out_dir, "stage_end")
    assert end["steps"] == 6 and end["stopped"] == "steps" and end["tokens"] == 6 * 4 * SEQ_LEN
    assert 0.0 <= end["wait_fraction"] <= 1.0 and end["delivered_samples_per_s"] > 0
    directory = ctx.checkpoint_dir
    assert ckpt.read_progress(directory)["finished"] == [0]
    assert (directory / "stage_0" / "replacement.safetensors").exists()
    assert ckpt.has_training_state(directory, 0)  # the step-3 checkpoint of the stage
    assert json.loads((directory / "current" / "state.json").read_text())["step"] == 3
    for key in ("stage_setup_s", "validation_s", "checkpoint_s", "student_compute_s"):
        assert ctx.timings[key] > 0, key


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_stage_that_fails_closes_its_loader_and_slot_pool(tmp_path: Path, pipeline_for, monkeypatch,
                                                            error: type[BaseException]) -> None:
    """Issue 40: ``train_stage`` closes the stage's loader on the way out of a failure or an
    interrupt (its thread gone, its segment unlinked) before the error reaches the caller."""
    cfg = _cfg(tmp_path)
    teacher = tiny_llama(VOCAB, 1)
    pipeline_for(cfg, teacher)
    ctx = _context(cfg, teacher, tmp_path / "run")
    before = set(list_segments())  # the control client's own slot
    calls = []

    def failing_loss(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise error("a step that fails")
        return layer_loss(*args, **kwargs)

    monkeypatch.setattr("distill.train.layer_stage.layer_loss", failing_loss)
    try:
        with pytest.raises(error, match="a step that fails"):
            train_stage(StageTrainer(ctx, LayerTask(ctx, ctx.stages[0])))
        assert not [t.name for t in threading.enumerate() if t.name.startswith("batches-stage")]
        ours = f"trainert_{os.getpid()}_"  # the run id's start and this process (another session may run it too)
        assert not [name for name in set(list_segments()) - before if ours in name]
    finally:
        ctx.client.close()


def test_a_stage_resumes_at_its_checkpoint(tmp_path: Path, pipeline_for) -> None:
    cfg = _cfg(tmp_path)
    teacher = tiny_llama(VOCAB, 1)
    pipeline_for(cfg, teacher)
    ctx = _context(cfg, teacher, tmp_path / "run")
    try:
        train_stage(StageTrainer(ctx, LayerTask(ctx, ctx.stages[0])))  # leaves its step-3 checkpoint behind
        resumed = StageTrainer(ctx, LayerTask(ctx, ctx.stages[0]))
        resumed.setup()
        assert resumed.start_step == 3
        state = json.loads((ctx.checkpoint_dir / "current" / "state.json").read_text())
        assert resumed.scheduler.last_epoch == state["scheduler"]["last_epoch"] == 3
        resumed.train()
        resumed.cleanup()
    finally:
        ctx.client.close()
    steps = [r["step"] for r in _events(ctx.out_dir, "train")]
    assert steps == [1, 2, 3, 4, 5, 6, 4, 5, 6], "the resumed stage trains only the steps after its checkpoint"


def test_patience_ends_a_stage_that_stops_improving(tmp_path: Path, pipeline_for) -> None:
    cfg = _cfg(tmp_path, "student.val_every_steps=1", "student.patience=1", "student.min_delta=100")
    teacher = tiny_llama(VOCAB, 1)
    pipeline_for(cfg, teacher)
    ctx = _context(cfg, teacher, tmp_path / "run")
    try:
        train_stage(StageTrainer(ctx, LayerTask(ctx, ctx.stages[0])))
    finally:
        ctx.client.close()
    (end,) = _events(ctx.out_dir, "stage_end")
    assert end["stopped"] == "patience" and end["steps"] == 2  # the first validation sets the best


def test_a_stage_ends_with_its_best_weights_also_after_a_resume(tmp_path: Path, pipeline_for) -> None:
    """A copy of the teacher layer starts at loss 0 and weight decay pulls it away step by
    step, so its first validation is its best: the stage must end with those weights, and a
    resumed stage must still know them."""
    cfg = _cfg(tmp_path, "student.val_every_steps=1", "student.weight_decay=2.0", replacement="copy")
    teacher = tiny_llama(VOCAB, 1)
    pipeline_for(cfg, teacher)
    ctx = _context(cfg, teacher, tmp_path / "run")
    try:
        train_stage(StageTrainer(ctx, LayerTask(ctx, ctx.stages[0])))  # leaves its step-3 checkpoint behind
        resumed = StageTrainer(ctx, LayerTask(ctx, ctx.stages[0]))
        resumed.setup()
        assert resumed.best.step == 1
        resumed.train()
        resumed.finish()
        resumed.cleanup()
    finally:
        ctx.client.close()
    vals = [r["student_losses"]["0"] for r in _events(ctx.out_dir, "val")]
    assert vals[0] < vals[-1]
    ends = _events(ctx.out_dir, "stage_end")
    assert [e["best_step"] for e in ends] == [1, 1] and ends[-1]["val"]["0"] == pytest.approx(vals[0])
    kept = StageModule({0: TeacherCopy(teacher, 0)})
    ckpt.load_stage_weights(ctx.checkpoint_dir, 0, kept)
    with torch.no_grad():
        x_BTD = teacher.embed(ctx.heldout_NT)
        restored = layer_loss(kept.blocks["0"](x_BTD), teacher.run_layer(teacher.layers[0], x_BTD), "nmse")
    assert float(restored) == pytest.approx(vals[0], rel=0.01)  # (validation averages per batch)


@pytest.mark.parametrize("kind", ["nmse", "cosine"])
def test_layer_loss_is_the_reference_formula(kind: str) -> None:
    torch.manual_seed(0)
    pred, target = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    if kind == "nmse":
        expected = F.mse_loss(pred, target) / target.pow(2).mean()
    else:
        expected = 1 - F.cosine_similarity(pred, target, dim=-1).mean()
    torch.testing.assert_close(layer_loss(pred, target, kind), expected)
    assert layer_loss(target, target, kind) < 1e-6
    with pytest.raises(ValueError, match="student.loss"):
        layer_loss(pred, target, "l1")


def test_cosine_schedule_warms_up_then_decays_to_its_floor() -> None:
    lrs = [cosine_lr(step, total=20, warmup=5, min_ratio=0.1) for step in range(25)]
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))
    assert lrs[20] == pytest.approx(0.1) and lrs[24] == pytest.approx(0.1)



class _ScaleTask:
    """A task that is none of distill's: one learned scale per layer, ``layer_out ~ s * layer_in``.
    Only the trainer's protocol reaches it, so a trainer that reached into a task's insides
    (its blocks, its closed loop) would fail here."""

    validate_at_start = True

    def __init__(self, ctx: StudentContext) -> None:
        self.ctx, self.stage = ctx, ctx.stages[0]
        self.planned = self.cfg = ctx.cfg.student
        self.calls: list[str] = []

    def build(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        self.calls.append("build")
        self.module = torch.nn.ParameterDict({str(layer): torch.nn.Parameter(torch.zeros(()))
                                              for layer in self.stage.layers})
        return self.module, self.module

    def prepare(self, start_step: int) -> None:
        self.calls.append(f"prepare {start_step}")

    def micro_step(self, batch: dict[str, torch.Tensor], accum: int) -> dict[int, float]:
        hidden_BPTD = batch["hidden"].float()
        losses = {}
        for layer in self.stage.layers:
            i, o = self.stage.io_index(layer)
            loss = (self.module[str(layer)] * hidden_BPTD[:, i] - hidden_BPTD[:, o]).pow(2).mean()
            (loss / accum).backward()
            losses[layer] = float(loss.detach())
        return losses

    def gradients(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0))

    def train_record(self, step: int, losses: dict[int, float], grad_norm: float, lr: float,
                     counters) -> tuple[dict, dict[str, str]]:
        return {"event": "scale_train", "step": step, "samples": counters.samples}, {}

    def validate(self, step: int) -> Validation:
        self.calls.append(f"validate {step}")
        self.seen = {layer: float(scale) for layer, scale in self.module.items()}
        return Validation(float(step), {"step": step})

    def finish(self) -> None:
        self.calls.append("finish")

    def progress_name(self) -> str:
        return "scales"


def test_the_trainer_runs_any_task_that_follows_its_protocol(tmp_path: Path, pipeline_for) -> None:
    cfg = _cfg(tmp_path, "student.val_every_steps=2", "student.lr=0.1")
    teacher = tiny_llama(VOCAB, 2)
    pipeline_for(cfg, teacher)
    ctx = _context(cfg, teacher, tmp_path / "run")
    task = _ScaleTask(ctx)
    try:
        train_stage(StageTrainer(ctx, task))
    finally:
        ctx.client.close()
    assert task.calls == ["build", "prepare 0", "validate 0", "validate 2", "validate 4", "validate 6", "finish"]
    assert [r["samples"] for r in _events(ctx.out_dir, "scale_train")] == [4, 8, 12, 16, 20, 24]
    assert all(scale != 0.0 for scale in task.seen.values()), "the steps trained the scales"
    assert all(float(scale) == 0.0 for scale in task.module.values()), "then the best (step-0) ones came back"
    (end,) = _events(ctx.out_dir, "stage_end")
    assert end["best_step"] == 0 and end["step"] == 0, "the task's step-0 weights scored best (lower is better)"
    kept = torch.nn.ParameterDict({str(layer): torch.nn.Parameter(torch.ones(())) for layer in ctx.stages[0].layers})
    ckpt.load_stage_weights(ctx.checkpoint_dir, 0, kept)
    assert all(float(scale) == 0.0 for scale in kept.values()), "the best (step-0) weights were saved"
