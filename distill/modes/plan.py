"""``python -m distill mode=plan ...``: what a run with these settings will cost, before it starts.

A 30-layer teacher on a CPU turns the defaults into a day-long run; nobody should learn that
from a progress bar hours in. This mode loads the teacher once, times the pieces a run is
made of on this machine, and projects the configured stages from them:

- the teacher: one worker batch (``pipeline.worker_max_batch`` chunks) through the whole model,
  so a layer costs ``t_full / L``; stage l makes the workers run layers 0..l for every sample;
- the student: one training step of a replacement (forward, loss, backward, ``micro_batch_size``
  chunks, ``grad_accum_steps`` times), plus, with closed-loop inputs (``student.inputs=student``),
  its own run of layers 0..l-1 to make the layer's input; a joint stage
  (``student.schedule=joint``) is one step of every replacement plus one run of the teacher's
  layers on the student's side, and the workers only embed;
- a stage's step takes the longer of the student's step and the teachers' share of it (the
  pipeline overlaps them: ``local.num_workers`` workers, or ``pipeline.teacher_workers``);
- the end-to-end stage: a forward and backward of the whole student per step, plus the teachers'
  full forward, a lower bound (its top-k targets, LM head and loss over the vocabulary come on
  top: on SmolLM2 a real step took several times this); the evaluation: about ``3 L`` layer passes per held-out batch, plus the
  spliced-alone scores bounded to the same (``distill.model.evaluate.per_layer_batches``).

Start-up, checkpoints and validation are left out; the figures are this machine's, with
whatever else it is running. Everything it prints is a projection, and says so.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from distill.config import Config, typed_config
from distill.model.location import teacher_source
from distill.model.sources import load_chunks, load_teacher, load_tokenizer
from distill.model.teacher import Teacher
from distill.stages import stage_layout
from distill.train.modules import build_replacement
from distill.train.progress import duration, e2e_step_estimate_s

log = logging.getLogger(__name__)

REPEATS = 3
"""Timed repetitions of each piece (after one untimed warm-up); the median is used."""


@dataclass(frozen=True)
class Timings:
    """Seconds of the pieces a run is made of, measured on this machine."""

    teacher_layer_per_sample_s: float
    """One teacher layer for one chunk (a worker batch through all layers / layers / batch)."""
    student_step_s: float
    """One optimizer step of one replacement (micro-batches included), without its inputs."""
    student_layer_per_sample_s: float
    """One frozen layer run by the student for closed-loop inputs, per chunk (no gradients)."""


def run_plan(cfg: DictConfig) -> None:
    """Time the pieces, project the stages, print the plan."""
    config = typed_config(cfg)
    source = teacher_source(config)
    teacher = load_teacher(source, config.teacher.dtype)
    chunks = load_chunks(config.data, load_tokenizer(source)).train_NT
    timings = measure(config, teacher, chunks)
    rows = project(config, teacher.num_layers, timings)
    print(render(rows, timings, config), flush=True)


def measure(cfg: Config, teacher: Teacher, chunks_NT: torch.Tensor) -> Timings:
    """Median times of a worker batch, a student step and a frozen layer on the student's side."""
    worker_batch = min(cfg.pipeline.worker_max_batch, len(chunks_NT))
    micro = min(cfg.student.micro_batch_size, len(chunks_NT))
    with torch.no_grad():
        full_s = _median(lambda: teacher.capture(chunks_NT[:worker_batch], [teacher.num_layers - 1]))
    layer_per_sample_s = full_s / teacher.num_layers / worker_batch
    replacement = build_replacement(cfg, teacher, 0)
    optimizer = torch.optim.AdamW([p for p in replacement.parameters() if p.requires_grad] or
                                  [torch.zeros(1, requires_grad=True)])
    with torch.no_grad():
        input_BTD = teacher.embed(chunks_NT[:micro]).float()
        target_BTD = teacher.run_layer(teacher.layers[0], input_BTD.to(teacher.dtype)).float()

    def step() -> None:
        for _ in range(cfg.student.grad_accum_steps):
            loss = torch.nn.functional.mse_loss(replacement(input_BTD), target_BTD)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return Timings(teacher_layer_per_sample_s=layer_per_sample_s, student_step_s=_median(step),
                   student_layer_per_sample_s=layer_per_sample_s)


def _median(work) -> float:
    work()  # warm-up: allocations, lazy initialisation, the teacher's per-length probe
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@dataclass(frozen=True)
class Row:
    what: str
    count: int
    steps: int
    step_s: float
    bound: str
    """"student" or "teacher": which side sets the pace."""

    @property
    def wall_s(self) -> float:
        return self.count * self.steps * self.step_s


def project(cfg: Config, num_layers: int, timings: Timings) -> list[Row]:
    """One row per kind of stage (the layer stages grouped), plus the end-to-end stage and the evaluation."""
    student, samples = cfg.student, cfg.student.micro_batch_size * cfg.student.grad_accum_steps
    workers = max(1, int(cfg.local.num_workers))
    stages, _ = stage_layout(cfg, num_layers, 1)
    closed_loop = str(student.inputs) != "teacher"
    walls = []
    for stage in stages:
        depth = max(stage.layers) + 1
        if stage.joint:  # the workers embed; the student runs the teacher's layers once, beside its own
            teacher_s, prefix_s = 0.0, depth * timings.student_layer_per_sample_s * samples
        else:
            teacher_s = depth * timings.teacher_layer_per_sample_s * samples / workers
            prefix_s = (min(stage.layers) * timings.student_layer_per_sample_s * samples) if closed_loop else 0.0
        student_s = timings.student_step_s * len(stage.layers) + prefix_s
        walls.append((max(teacher_s, student_s), "teacher" if teacher_s > student_s else "student"))
    rows = []
    if stages:
        mean_step_s = sum(w for w, _ in walls) / len(walls)
        teacher_bound = sum(1 for _, b in walls if b == "teacher")
        rows.append(Row(f"layer stages ({stages[0].kind})", len(stages), int(student.steps_per_stage), mean_step_s,
                        f"teacher in {teacher_bound} of {len(stages)}" if teacher_bound else "student"))
    if student.e2e.steps > 0:
        full_s = num_layers * timings.teacher_layer_per_sample_s * samples
        rows.append(Row("end-to-end stage (at least: forward and backward of the model only)", 1,
                        int(student.e2e.steps), e2e_step_estimate_s(full_s, workers), "student"))
    heldout = min(cfg.data.max_heldout_chunks or 10**9, 10**9)
    batches = max(1, -(-heldout // student.micro_batch_size)) if cfg.evaluate else 0
    if batches and heldout < 10**9:
        eval_s = 6 * num_layers * timings.teacher_layer_per_sample_s * student.micro_batch_size
        rows.append(Row("evaluation (held-out)", 1, batches, eval_s, "student"))
    return rows


def render(rows: list[Row], timings: Timings, cfg: Config) -> str:
    """The plan as a table with its total, and what it leaves out."""
    lines = [
        "Projected wall time of this run on this machine (a projection from timed pieces, not a promise):",
        "",
        "| part | count | steps each | s/step | set by | projected |",
        "| --- | --- | --- | --- | --- | --- |",
        *[f"| {r.what} | {r.count} | {r.steps:,} | {r.step_s:.3f} | {r.bound} | {duration(r.wall_s)} |" for r in rows],
        f"| **total** | | | | | **{duration(sum(r.wall_s for r in rows))}** |",
        "",
        f"Measured: a teacher layer {1e3 * timings.teacher_layer_per_sample_s:.2f} ms per chunk of "
        f"{cfg.data.seq_len} tokens; a student step {1e3 * timings.student_step_s:.1f} ms "
        f"({cfg.student.micro_batch_size} chunks x {cfg.student.grad_accum_steps}). Left out: start-up "
        "(loading the teacher in every process), validation, checkpoints. To shorten it: fewer "
        "student.steps_per_stage, student.schedule=joint (one teacher pass per token for all layers), "
        "student.layers_per_stage > 1 (one teacher pass for several layers), "
        "more teacher workers (local.num_workers) where the teacher sets the pace.",
    ]
    return "\n".join(lines)
