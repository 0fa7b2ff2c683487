"""Peak memory of one training step of an exported student, with and without activation checkpointing.

``python bench/memory.py --checkpointing`` runs this (item 5 of that module's docstring). A
random-weights Llama (``inference.CONFIG``: hidden 512, 8 layers, 8 heads, MLP 1376,
vocab 8192, seed 0) gets a mixed student, five replacement kinds beside two kept teacher layers
(``LAYERS``), exported with ``export_student`` and loaded back with ``load_student`` as a user
fine-tuning it gets it. Each cell (plain, checkpointed) runs in a fresh spawned process: load
the student, make the batch, reset the process's high-water mark (``/proc/self/clear_refs``: 5),
then ``STEPS`` forwards (next-token cross-entropy, no cache) and backwards, gradients set afresh
each; the peak is ``ru_maxrss`` of ``getrusage`` after them, the time the median step after
the first. The cell writes its gradients to a file, so the parent compares them.

Shape legend: B batch, T tokens.
"""

from __future__ import annotations

import gc
import os
import resource
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
from children import SPAWN  # bench/children.py
from inference import CONFIG  # bench/inference.py
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from distill.model.assemble import export_student, load_student
from distill.model.teacher import Teacher
from distill.replacements.gated_linear_attention import GatedLinearAttentionLayer
from distill.replacements.linear_attention import LinearAttentionLayer
from distill.replacements.mlp import ResidualMLP
from distill.replacements.pruned import PrunedLayer
from distill.replacements.sliding_window_linear import SlidingWindowLinearLayer

LAYERS = {0: (LinearAttentionLayer, {}), 1: (SlidingWindowLinearLayer, {}), 2: (GatedLinearAttentionLayer, {}),
          4: (ResidualMLP, {"hidden_mult": 1.0}), 5: (PrunedLayer, {"mlp_keep_fraction": 0.5}),
          6: (LinearAttentionLayer, {})}
"""Replaced layers and their options (defaults: chunks of 64, hedgehog features, a window of 16);
layers 3 and 7 stay the teacher's softmax attention."""
CFG = {"_target_": "recorded.only", "_partial_": True}
BATCH, SEQ_LEN = 2, 1024
STEPS = 3
"""Steps per cell: the peak is over all; the time is the median of all but the first (which touches
its memory for the first time)."""
GRAD_ATOL = 1e-4
"""Largest gradient difference allowed between the cells: the replay recomputes the same
forward, so only a different reduction order could move a gradient."""
MIB = 2**20


@dataclass
class Cell:
    """One training step in its own process: RSS before it, its peak, its seconds."""

    checkpointing: bool
    rss_before_bytes: int
    peak_bytes: int
    step_s: float
    """Median seconds of the steps after the first."""
    reset: bool
    """Whether the high-water mark was reset before the step (else ``peak_bytes`` is the process's)."""

    @property
    def step_bytes(self) -> int:
        return self.peak_bytes - self.rss_before_bytes


def export_mixed_student(out_dir: str) -> str:
    """The random Llama's mixed student (``LAYERS``), written to ``out_dir``; a description."""
    torch.manual_seed(0)
    teacher = Teacher(LlamaForCausalLM(LlamaConfig(**CONFIG)))
    replacements = {idx: cls(teacher, idx, **options) for idx, (cls, options) in LAYERS.items()}
    export_student(teacher, "random-llama", replacements, dict.fromkeys(replacements, CFG), out_dir)
    kinds = ", ".join(f"{idx} {module.layer_spec()['kind']}" for idx, module in replacements.items())
    return f"random Llama (hidden {CONFIG['hidden_size']}, {teacher.num_layers} layers), replaced: {kinds}"


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _reset_high_water_mark() -> bool:
    """Set this process's peak RSS (VmHWM, and with it ``ru_maxrss``) to its RSS now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _step(model: torch.nn.Module, ids_BT: torch.Tensor) -> float:
    """One forward (next-token cross-entropy) and backward, gradients set afresh; its seconds."""
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    logits_BTV = model(ids_BT, attention_mask=torch.ones_like(ids_BT), use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits_BTV[:, :-1].flatten(0, 1), ids_BT[:, 1:].flatten())
    del logits_BTV
    loss.backward()
    return time.perf_counter() - started


def _cell(student_dir: str, checkpointing: bool, grads_path: str, results) -> None:
    """Two training steps of the loaded student in a fresh process (see the module docstring)."""
    model = load_student(student_dir).requires_grad_(True).train()
    if checkpointing:
        model.activation_checkpointing_enable()
    ids_BT = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    gc.collect()
    reset = _reset_high_water_mark()
    rss_before = _rss_bytes()
    step_s = [_step(model, ids_BT) for _ in range(STEPS)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    save_file({name: p.grad for name, p in model.named_parameters() if p.grad is not None}, grads_path)
    results.put(Cell(checkpointing, rss_before, peak, statistics.median(step_s[1:]), reset))


def run_cell(student_dir: str, checkpointing: bool, grads_path: str) -> Cell:
    results = SPAWN.Queue()
    proc = SPAWN.Process(target=_cell, args=(student_dir, checkpointing, grads_path, results))
    proc.start()
    try:
        cell = results.get(timeout=600)
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    if proc.exitcode != 0:
        raise RuntimeError(f"the {'checkpointed' if checkpointing else 'plain'} cell exited with {proc.exitcode}")
    return cell


def max_grad_diff(plain_path: str, checkpointed_path: str) -> tuple[float, float, int]:
    """Largest absolute difference between the two cells' gradients, the largest gradient, the count."""
    plain, checkpointed = load_file(plain_path), load_file(checkpointed_path)
    if plain.keys() != checkpointed.keys():
        raise AssertionError(f"gradients of different parameters: {sorted(plain.keys() ^ checkpointed.keys())}")
    diff = max((plain[name] - checkpointed[name]).abs().max().item() for name in plain)
    return diff, max(grad.abs().max().item() for grad in plain.values()), len(plain)


def checkpointing_main() -> int:
    """Both cells, then one table and the gradient check."""
    work = tempfile.mkdtemp(prefix="distill-ckpt-mem-")
    try:
        described = export_mixed_student(os.path.join(work, "student"))
        cells = [run_cell(os.path.join(work, "student"), flag, os.path.join(work, f"grads{int(flag)}.safetensors"))
                 for flag in (False, True)]
        diff, largest, count = max_grad_diff(*(os.path.join(work, f"grads{i}.safetensors") for i in (0, 1)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"one training step (forward + backward, next-token cross-entropy) of an exported mixed student: "
          f"{described}; batch {BATCH} x {SEQ_LEN} tokens, float32, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; each cell a fresh process, peak = ru_maxrss over {STEPS} steps"
          + ("" if all(c.reset for c in cells) else " (high-water mark NOT reset: the process's whole-life peak)"))
    print("\n| activation checkpointing | RSS before the step MiB | peak RSS MiB | peak above RSS before MiB "
          "| step s |\n| --- | --- | --- | --- | --- |")
    for cell in cells:
        print(f"| {'on' if cell.checkpointing else 'off'} | {cell.rss_before_bytes / MIB:.0f} | "
              f"{cell.peak_bytes / MIB:.0f} | {cell.step_bytes / MIB:.0f} | {cell.step_s:.2f} |")
    plain, checkpointed = cells
    print(f"| on / off | {checkpointed.rss_before_bytes / plain.rss_before_bytes:.2f}x | "
          f"{checkpointed.peak_bytes / plain.peak_bytes:.2f}x | {checkpointed.step_bytes / plain.step_bytes:.2f}x | "
          f"{checkpointed.step_s / plain.step_s:.2f}x |")
    same = diff <= GRAD_ATOL
    print(f"\ngradients of {count} parameters: max abs difference {diff:.2e} (largest gradient {largest:.2e}; "
          f"allowed {GRAD_ATOL:.0e}): {'equal' if same else 'DIFFERENT'}")
    return 0 if same else 1
