"""wrap_for_training with FSDP2 on 2 gloo ranks: sharded training of the end-to-end student
matches DDP, and a checkpoint taken mid-stage resumes to the very same weights, in the files
of distill.train.checkpoint (whole tensors, the unwrapped module's names)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import load_file

from tests.conftest import MP, Procs

WORLD = 2
STEPS, ACCUM, RESUME_AT = 4, 2, 2
TRAINABLE = ("all", "replacements")


def _student(trainable: str):
    from distill.replacements.mlp import ResidualMLP
    from distill.train.e2e import E2EStudent
    from tests.tiny_teachers import tiny_llama

    teacher = tiny_llama(vocab_size=40, num_layers=3)
    torch.manual_seed(1)
    replacements = {idx: ResidualMLP(teacher, idx).float() for idx in (0, 2)}
    return E2EStudent(teacher, replacements, trainable, loss_chunk_tokens=6)


def _batches(rank: int) -> list[tuple[torch.Tensor, ...]]:
    """This rank's micro-batches: ids and the teacher's top-k (random but fixed)."""
    gen = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(STEPS * ACCUM):
        logp, idx = torch.randn(2, 8, 40, generator=gen).log_softmax(-1).topk(4, dim=-1)
        out.append((torch.randint(0, 40, (2, 8), generator=gen), logp, idx))
    return out


def _train(model, module, optimizer, batches, steps: range) -> None:
    from distill.train.context import gradient_sync

    for step in steps:
        for micro in range(ACCUM):
            with gradient_sync(model, sync=micro == ACCUM - 1):
                loss, _ = model(*batches[step * ACCUM + micro])
                (loss / ACCUM).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _wrapped(trainable: str, parallel: str):
    from distill.train.context import wrap_for_training

    ctx = SimpleNamespace(world_size=WORLD, device=torch.device("cpu"))
    module = _student(trainable)
    model = wrap_for_training(module, ctx, parallel)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return module, model, optimizer, scheduler


def _rank(rank: int, init_file: str, directory: str, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    for trainable in TRAINABLE:
        _compare(rank, Path(directory) / trainable, trainable, results)
    dist.destroy_process_group()


def _local_fraction(module) -> float:
    """Share of the trained parameters this rank holds."""
    from torch.distributed.tensor import DTensor

    trained = [p for p in module.parameters() if p.requires_grad]
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in trained)
    return local / sum(p.numel() for p in trained)


def _compare(rank: int, path: Path, trainable: str, results) -> None:
    """DDP for STEPS; FSDP2 for RESUME_AT, checkpoint, the rest; resumed from it, the rest."""
    import torch.distributed as dist

    from distill.train import checkpoint as ckpt
    from distill.train.context import is_sharded

    batches = _batches(rank)
    ddp, ddp_model, ddp_opt, _ = _wrapped(trainable, "ddp")
    _train(ddp_model, ddp, ddp_opt, batches, range(STEPS))

    fsdp, model, optimizer, scheduler = _wrapped(trainable, "fsdp")
    assert is_sharded(fsdp) and not is_sharded(ddp)
    fraction = _local_fraction(fsdp)
    _train(model, fsdp, optimizer, batches, range(RESUME_AT))
    ckpt.save_training_state(path, stage=0, step=RESUME_AT, module=fsdp, optimizer=optimizer,
                             scheduler=scheduler, extra={}, write=rank == 0)
    dist.barrier()
    _train(model, fsdp, optimizer, batches, range(RESUME_AT, STEPS))
    straight = ckpt.model_state(fsdp)

    resumed, model, optimizer, scheduler = _wrapped(trainable, "fsdp")
    assert ckpt.load_training_state(path, module=resumed, optimizer=optimizer, scheduler=scheduler)["step"] == RESUME_AT
    _train(model, resumed, optimizer, batches, range(RESUME_AT, STEPS))
    again = ckpt.model_state(resumed)
    ckpt.save_stage_weights(path, 1, resumed, write=rank == 0)
    if rank == 0:
        reference = ddp.state_dict()
        results.put({"trainable": trainable, "fraction": fraction,
                     "keys": set(straight) == set(reference) == set(again),
                     "resume_error": max((straight[k] - again[k]).abs().max().item() for k in straight),
                     "ddp_error": max((straight[k].float() - reference[k].float()).abs().max().item()
                                      for k in straight),
                     "moved": max((straight[k].float() - _student(trainable).state_dict()[k].float()).abs().max().item()
                                  for k in straight)})
    dist.barrier()


def test_fsdp_trains_as_ddp_and_resumes_exactly(tmp_path: Path, procs: Procs) -> None:
    """trainable=all shards the whole student; replacements shards only them (the frozen
    teacher parts stay the teacher's own, unsharded)."""
    results = MP.Queue()
    init_file = str(tmp_path / "init")
    ranks = [procs.start(_rank, rank, init_file, str(tmp_path / "ckpt"), results, name=f"rank{rank}")
             for rank in range(WORLD)]
    found = procs.collect(results, len(TRAINABLE), ranks, timeout_s=120)
    for proc in ranks:
        procs.join(proc, 30)
    for result in found:
        assert result["keys"], result
        assert result["fraction"] <= 0.55, result  # each rank holds about half
        assert result["moved"] > 1e-3, result  # it trained
        assert result["resume_error"] == 0.0, result
        assert result["ddp_error"] < 1e-5, result
        directory = tmp_path / "ckpt" / result["trainable"]
        assert (directory / "current" / "optimizer.safetensors").exists()
        _student(result["trainable"]).load_state_dict(load_file(str(directory / "stage_1" / "replacement.safetensors")))


def _average_rank(rank: int, init_file: str, results) -> None:
    """DDP's reduced gradients against a plain module's, averaged by average_gradients."""
    import torch.distributed as dist

    from distill.replacements.mlp import ResidualMLP
    from distill.train.context import average_gradients, wrap_for_training
    from tests.tiny_teachers import tiny_llama

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    teacher = tiny_llama(vocab_size=40, num_layers=2)
    ctx = SimpleNamespace(world_size=WORLD, device=torch.device("cpu"))
    input_BTD = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(rank))
    grads = []
    for wrapped in (True, False):
        torch.manual_seed(1)
        module = ResidualMLP(teacher, 0).float()
        model = wrap_for_training(module, ctx) if wrapped else module
        model(input_BTD).pow(2).mean().backward()
        if not wrapped:
            average_gradients(module, ctx)
        grads.append([p.grad.clone() for p in module.parameters() if p.requires_grad])
    if rank == 0:
        results.put(max((a - b).abs().max().item() for a, b in zip(*grads, strict=True)))
    dist.barrier()
    dist.destroy_process_group()


def test_average_gradients_reduces_as_ddp_does(tmp_path: Path, procs: Procs) -> None:
    """A joint stage trains without DDP (one backward per layer) and averages its gradients itself."""
    results = MP.Queue()
    ranks = [procs.start(_average_rank, rank, str(tmp_path / "init"), results, name=f"rank{rank}")
             for rank in range(WORLD)]
    (error,) = procs.collect(results, 1, ranks, timeout_s=120)
    for proc in ranks:
        procs.join(proc, 30)
    assert error < 1e-6
