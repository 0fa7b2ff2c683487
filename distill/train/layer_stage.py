"""The layer stage: fresh replacements of a stage's layers, each trained to give its teacher
layer's output (a task for :class:`~distill.train.trainer.StageTrainer`).

The same task trains an automatic hybrid's scoring pass (with the scoring settings, see
:mod:`distill.train.hybrid`). A joint stage (``student.schedule=joint``) builds every input
itself from one teacher pass (:mod:`distill.train.joint`) and backpropagates layer by layer;
otherwise the inputs are the teacher's, or the student's own prefix
(:mod:`distill.train.closed_loop`).

Shape legend: B batch, P boundary positions of a stage, T tokens, D hidden size.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from distill.config import StudentConfig
from distill.stages import Stage
from distill.train.closed_loop import ClosedLoopInputs, build_closed_loop
from distill.train.context import StudentContext, average_gradients, barrier, wrap_for_training
from distill.train.counters import StageCounters
from distill.train.joint import JointTraining, JointValidation
from distill.train.losses import layer_loss
from distill.train.modules import StageModule, build_stage_module, load_stage_replacements
from distill.train.stopping import with_budget
from distill.train.validation import LayerValidation, Validation, by_str

log = logging.getLogger(__name__)


class LayerTask:
    """Replacements of ``stage``'s layers, each with its own loss against its teacher layer."""

    validate_at_start = False  # fresh replacements: their step-0 weights are nobody's best

    def __init__(self, ctx: StudentContext, stage: Stage, student_cfg: StudentConfig | None = None) -> None:
        """``student_cfg``: the stage's settings when not ``ctx.cfg.student`` (the scoring pass)."""
        self.ctx = ctx
        self.stage = stage
        self.planned = student_cfg or ctx.cfg.student
        self.cfg = with_budget(self.planned, ctx.world_size, ctx.cfg.data.seq_len)
        self.closed_loop: ClosedLoopInputs | None = None
        self.joint: JointTraining | None = None
        self.validation: LayerValidation | None = None

    def build(self) -> tuple[nn.Module, nn.Module]:
        """The stage's replacements, and what the steps run (DDP-wrapped, except a joint stage,
        which backpropagates layer by layer and averages its gradients itself)."""
        self.module: StageModule = build_stage_module(self.ctx.cfg, self.ctx.teacher, self.stage).to(self.ctx.device)
        self.model: nn.Module = self.module if self.stage.joint else wrap_for_training(self.module, self.ctx)
        return self.module, self.model

    def prepare(self, start_step: int) -> None:
        """Held-out targets (leader) and the builder of the stage's inputs, from the replacements
        of the stages before this one (frozen; loaded only where they are needed)."""
        ctx = self.ctx
        earlier: dict[int, nn.Module] = {}
        if self.stage.closed_loop or ctx.leader:
            earlier = load_stage_replacements(ctx, [s for s in ctx.stages if s.index < self.stage.index])
        self._prepare_validation(earlier)
        if self.stage.joint:
            cfg = self.cfg
            self.joint = JointTraining(ctx.teacher, self.stage, cfg.inputs, cfg.loss, cfg.steps_per_stage,
                                       cfg.grad_accum_steps, start_step, cfg.seed)
            log.info("stage %d: layers %s trained jointly (%s inputs), one teacher pass per token",
                     self.stage.index, span(self.stage.layers), cfg.inputs)
            return
        self.closed_loop = build_closed_loop(ctx, self.stage, earlier, self.cfg.steps_per_stage, start_step)

    def _prepare_validation(self, earlier: dict[int, nn.Module]) -> None:
        ctx = self.ctx
        if not (ctx.leader and len(ctx.heldout_NT)):
            return
        if self.stage.joint:
            self.validation = JointValidation(ctx.teacher, self.stage, ctx.heldout_NT, self.cfg.micro_batch_size,
                                              ctx.device, self.cfg.loss)
        else:
            self.validation = LayerValidation(ctx.teacher, self.stage, ctx.heldout_NT, earlier,
                                              self.cfg.micro_batch_size, ctx.device, self.cfg.loss)

    def micro_step(self, batch: dict[str, torch.Tensor], accum: int) -> dict[int, float]:
        """Forward and backward of one micro-batch (gradients scaled by 1/accum); per-layer losses."""
        if self.joint is not None:
            embed_BTD = batch["hidden"][:, 0].to(self.ctx.device, non_blocking=True)
            return self.joint(embed_BTD, self.module.blocks)
        hidden_BPTD = batch["hidden"].to(self.ctx.device, non_blocking=True)
        inputs, targets = {}, {}
        for layer in self.stage.layers:
            i, o = self.stage.io_index(layer)
            inputs[layer] = hidden_BPTD[:, i].float()
            targets[layer] = hidden_BPTD[:, o]
        if self.closed_loop is not None:
            inputs = self.closed_loop(hidden_BPTD, inputs, self.module.blocks)
        preds = self.model(inputs)
        per_layer = {layer: layer_loss(preds[layer], targets[layer], self.cfg.loss) for layer in preds}
        loss = torch.stack(list(per_layer.values())).sum()  # each layer's gradient is its own loss's
        (loss / accum).backward()
        return {layer: float(v.detach()) for layer, v in per_layer.items()}

    def gradients(self) -> float:
        """Clip each replacement's gradients on their own (the layers' losses are independent,
        so a layer's step does not shrink because other layers share its stage); the largest
        norm before clipping. A joint stage first averages them over the ranks."""
        if self.joint is not None:
            average_gradients(self.module, self.ctx)
        norms = [torch.nn.utils.clip_grad_norm_(block.parameters(), self.cfg.grad_clip)
                 for block in self.module.blocks.values()]
        return max(float(norm) for norm in norms)

    def train_record(self, step: int, losses: dict[int, float], grad_norm: float, lr: float,
                     counters: StageCounters) -> tuple[dict, dict[str, str]]:
        """A ``train`` event (per-layer losses) and the progress bar's figures."""
        mean = sum(losses.values()) / max(1, len(losses))
        rate, wait = counters.samples_per_s(), counters.wait_fraction()
        record = {"event": "train", "stage": self.stage.index, "kind": self.stage.kind,
                  "layers": list(self.stage.layers), "step": step, "loss": mean,
                  "layer_losses": by_str(losses), "lr": lr, "grad_norm": grad_norm, "samples_per_s": rate,
                  "wait_fraction": wait, "time_s": counters.elapsed_s()}
        return record, {"loss": f"{mean:.4f}", "samples_s": f"{rate:.3g}", "wait": f"{wait:.0%}"}

    @torch.no_grad()
    def validate(self, step: int) -> Validation:
        """Per-layer losses on the fixed held-out set, teacher-forced and on the student's own
        inputs (leader only; others wait at the barrier and get an empty Validation)."""
        result = Validation()
        if self.validation is not None:
            self.module.eval()
            result = self.validation(self.module.blocks)
            self.module.train()
            self.ctx.log_metrics({"event": "val", "stage": self.stage.index, "kind": self.stage.kind, "step": step,
                                  "layer_losses": by_str(result.record["val"]),
                                  "student_losses": by_str(result.record["val_student"])})
            log.info("stage %d step %d validation (teacher inputs / student inputs): %s", self.stage.index, step,
                     ", ".join(f"layer {k}: {v:.4f} / {result.record['val_student'][k]:.4f}"
                               for k, v in result.record["val"].items()))
        barrier(self.ctx)
        return result

    def finish(self) -> None:
        """Nothing to fold in: the replacements are saved as they are."""

    def progress_name(self) -> str:
        """The stage as its progress bar names it."""
        if self.stage.joint:
            return f"stage {self.stage.index} layers {span(self.stage.layers)} jointly"
        what = "scoring layers" if self.stage.kind == "score" else "layers"
        return f"stage {self.stage.index} {what} {','.join(map(str, self.stage.layers))}"


def span(layers: tuple[int, ...]) -> str:
    """``0-29`` for a run of consecutive layers, else the list."""
    if len(layers) > 2 and list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers))
