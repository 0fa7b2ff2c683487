"""Stages: which teacher layers are trained together, and what a sample of a stage holds.

A stage trains ``layers_per_stage`` layers from one teacher pass. A sample holds the
token ids and the hidden states at the stage's *boundaries*: position p is the input
of layer p (= the output of layer p-1). For consecutive layers l..l+k-1 that is k+1
states instead of 2k; each replacement still sees the teacher's own input.

The payload layout is fixed for a whole run (the largest stage), so a student's
slots never need resizing between stages.

Two options widen that layout. A closed-loop stage (``student.inputs=student|mix``) also
carries position 0, the embeddings, from which the student runs its own trained
replacements to build each layer's input. When the end-to-end stage is on, every sample
has room for the teacher's top-k next-token log-probabilities (``topk_logp`` and
``topk_idx``, [T, k]; not for an encoder, which has none); that stage writes the
teacher's final hidden state into ``hidden[0]`` (see :mod:`distill.teacher.targets`).

:func:`stage_layout` is the one place that turns a config and a teacher's shape into the
stages and the sample layout: the start-up checks, the workers and the students all call
it, so they can never disagree about what a slot holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from distill.config import Config, Family, Inputs, Schedule, StudentConfig
from distill.model.location import has_lm_head, teacher_model
from distill.pipeline import BatchConfig, TensorSpec


@dataclass(frozen=True)
class Stage:
    index: int
    layers: tuple[int, ...]
    closed_loop: bool = False
    """The sample also carries the embeddings (position 0) for closed-loop inputs."""
    kind: str = "layers"
    """``layers`` (per-layer targets), ``score`` (per-layer targets for an automatic hybrid's
    scoring pass, see distill.train.hybrid) or ``e2e`` (top-k log-probabilities of the full model)."""
    joint: bool = False
    """Every layer trained at once from the embeddings alone (``student.schedule=joint``, see
    distill.train.joint): a sample carries position 0 only, and the student runs the chain."""

    @property
    def positions(self) -> tuple[int, ...]:
        """Boundary positions whose hidden states a sample carries, ascending."""
        if self.joint:
            return (0,)
        boundaries = {p for layer in self.layers for p in (layer, layer + 1)}
        if self.closed_loop:
            boundaries.add(0)
        return tuple(sorted(boundaries))

    @property
    def model_id(self) -> str:
        loop = ":joint" if self.joint else ":closed" if self.closed_loop else ""
        return f"stage{self.index}:{self.kind}" + ",".join(map(str, self.layers)) + loop

    @property
    def model_cfg(self) -> dict:
        cfg: dict = {"stage": self.index, "layers": list(self.layers)}
        if self.closed_loop:
            cfg["closed_loop"] = True
        if self.joint:
            cfg["joint"] = True
        if self.kind != "layers":
            cfg["kind"] = self.kind
        return cfg

    @classmethod
    def from_model_cfg(cls, model_cfg: dict | None) -> Stage:
        """The stage a worker is asked for (inverse of ``model_cfg``)."""
        model_cfg = model_cfg or {}
        return cls(int(model_cfg.get("stage", 0)), tuple(model_cfg["layers"]),
                   bool(model_cfg.get("closed_loop", False)), str(model_cfg.get("kind", "layers")),
                   bool(model_cfg.get("joint", False)))

    @property
    def captured_layers(self) -> list[int]:
        """The teacher layers whose inputs or outputs a worker captures for this stage."""
        if self.joint:
            return [0]
        return [*self.layers, *([0] if self.closed_loop else [])]

    def io_index(self, layer: int) -> tuple[int, int]:
        """Indices into the sample's ``hidden`` of layer's input and output."""
        return self.positions.index(layer), self.positions.index(layer + 1)


def plan_stages(num_layers: int, layers: list[int] | None, layers_per_stage: int,
                closed_loop: bool = False, first_index: int = 0, kind: str = "layers") -> list[Stage]:
    """Split the layers to replace into stages of ``layers_per_stage``, numbered from ``first_index``."""
    chosen = sorted(set(range(num_layers) if layers is None else layers))
    bad = [layer for layer in chosen if not 0 <= layer < num_layers]
    if bad:
        raise ValueError(f"student.layers has {bad}, outside the teacher's layers 0..{num_layers - 1}; "
                         "fix student.layers or leave it null for all layers")
    if layers_per_stage < 1:
        raise ValueError(f"student.layers_per_stage={layers_per_stage} must be >= 1")
    if not chosen:
        raise ValueError("student.layers is empty: name at least one layer, or null for all")
    groups = [chosen[i:i + layers_per_stage] for i in range(0, len(chosen), layers_per_stage)]
    return [Stage(first_index + i, tuple(group), closed_loop, kind) for i, group in enumerate(groups)]


def max_positions(stages: list[Stage]) -> int:
    return max(len(stage.positions) for stage in stages)


def sample_batch_config(num_positions: int, seq_len: int, hidden_size: int, dtype: str,
                        top_k: int = 0) -> BatchConfig:
    """The layout of one sample: token ids + ``num_positions`` hidden states (+ top-k log-probs)."""
    specs = [
        TensorSpec("input_ids", (seq_len,), "int64"),
        TensorSpec("hidden", (num_positions, seq_len, hidden_size), dtype),
    ]
    if top_k:
        specs += [TensorSpec("topk_logp", (seq_len, top_k), "float32"),
                  TensorSpec("topk_idx", (seq_len, top_k), "int64")]
    return BatchConfig(specs)


def closed_loop(student_cfg: StudentConfig) -> bool:
    """Whether layer stages feed replacements student-built inputs (``student.inputs``)."""
    return student_cfg.inputs != Inputs.teacher


def teacher_is_lm(cfg: Config) -> bool:
    """Whether the configured teacher predicts tokens (has an LM head), from its config alone."""
    model = teacher_model(cfg)
    if model is None:
        return cfg.teacher.tiny.family == Family.llama
    return has_lm_head(model)


def e2e_top_k(cfg: Config) -> int:
    """Log-probabilities per token a sample must hold: 0 unless the end-to-end stage is on
    (for a teacher with an LM head; an encoder's end-to-end stage needs only its final state)."""
    return int(cfg.student.e2e.top_k) if cfg.student.e2e.steps > 0 and teacher_is_lm(cfg) else 0


def e2e_stage(stages: list[Stage]) -> Stage:
    """The end-to-end stage that follows the layer stages. It trains the whole student, so it
    names no layers (the report counts no layer budget against it)."""
    return Stage(stages[-1].index + 1, (), kind="e2e")


def hybrid_on(student_cfg: StudentConfig) -> bool:
    """Whether the layers to convert are chosen by a scoring pass (``student.hybrid``)."""
    return student_cfg.hybrid.keep_softmax is not None or student_cfg.hybrid.max_gap is not None


def scoring_stages(cfg: Config, num_layers: int) -> list[Stage]:
    """The stages of an automatic hybrid's scoring pass: every candidate layer, teacher-forced."""
    student = cfg.student
    return plan_stages(num_layers, student.layers, student.layers_per_stage, kind="score")


def layer_stages(cfg: Config, num_layers: int, layers: list[int] | None, first_index: int = 0) -> list[Stage]:
    """The layer stages that convert ``layers``, as the student config plans them: one joint
    stage of them all (``student.schedule=joint``), or stages of ``layers_per_stage``."""
    student = cfg.student
    if joint_schedule(student):
        (stage,) = plan_stages(num_layers, layers, num_layers, closed_loop(student), first_index)
        return [Stage(stage.index, stage.layers, stage.closed_loop, stage.kind, joint=True)]
    return plan_stages(num_layers, layers, student.layers_per_stage, closed_loop(student), first_index)


def joint_schedule(student_cfg: StudentConfig) -> bool:
    """Whether the layer stages are one joint stage (``student.schedule``)."""
    return student_cfg.schedule == Schedule.joint


def _hybrid_positions(cfg: Config, num_layers: int) -> int:
    """Most boundary positions a layer stage of an automatic hybrid can have, whichever layers
    the scoring pass picks: k layers with no two adjacent (+ the embeddings in closed loop)."""
    if joint_schedule(cfg.student):
        return 1
    k = cfg.student.layers_per_stage
    return min(2 * k + int(closed_loop(cfg.student)), num_layers + 1)


def stage_layout(cfg: Config, num_layers: int, hidden_size: int) -> tuple[list[Stage], BatchConfig]:
    """The run's layer stages and the layout of one sample, from the config and the teacher's
    shape (checks, workers and students all call this; see the module docstring).

    With an automatic hybrid the stages are those of its scoring pass (the layer stages follow
    once it has chosen, :func:`layer_stages`), and the layout has room for any layer stage it
    may choose."""
    student = cfg.student
    if hybrid_on(student):
        stages = scoring_stages(cfg, num_layers)
        positions = max(max_positions(stages), _hybrid_positions(cfg, num_layers))
    else:
        stages = layer_stages(cfg, num_layers, student.layers)
        positions = max_positions(stages)
    batch_config = sample_batch_config(positions, cfg.data.seq_len, hidden_size, cfg.teacher.dtype,
                                       top_k=e2e_top_k(cfg))
    return stages, batch_config
