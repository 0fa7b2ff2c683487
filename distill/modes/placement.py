"""Which GPUs the teacher workers and the student ranks of one machine use, decided up front.

A teacher and a student on one GPU compete for its memory and compute, and the teacher's
memory (a large model, batches of activations) is what makes a student run out of it; so
mode=local never puts both on one GPU unless ``device.share_gpu=true`` asks for it. The
placement is computed once, checked at start-up (``distill.modes.checks``), logged, and
handed to the student ranks as ``device.student_gpus`` (``distill.modes.local``), so what
runs is what was checked. A student rank started on its own (mode=student under torchrun)
uses ``device.student_gpus[LOCAL_RANK]``, or device LOCAL_RANK.
"""

from __future__ import annotations

from dataclasses import dataclass

from distill.config import Config


@dataclass(frozen=True)
class GpuPlacement:
    """CUDA device indices of this machine's teacher workers and student ranks."""

    worker_gpus: tuple[int, ...]
    """Every worker's teacher sits on these (one GPU, or spread over several)."""
    student_gpus: tuple[int, ...]
    """Local rank r trains on student_gpus[r]; empty when the students run on CPU."""

    def describe(self) -> str:
        workers = ",".join(f"cuda:{g}" for g in self.worker_gpus) or "cpu"
        students = ",".join(f"cuda:{g}" for g in self.student_gpus) or "cpu"
        return f"teacher workers on {workers}, student ranks on {students}"


def worker_gpus(cfg: Config) -> tuple[int, ...]:
    """The GPUs a worker's teacher takes: ``device.worker_gpus``, else ``device.worker_gpu``."""
    if cfg.device.worker_gpus:
        return tuple(int(g) for g in cfg.device.worker_gpus)
    return () if cfg.device.worker_gpu is None else (int(cfg.device.worker_gpu),)


def plan_local(cfg: Config, device_count: int) -> GpuPlacement:
    """The placement of mode=local on a machine with ``device_count`` GPUs, or a ValueError
    naming the keys to change."""
    workers = worker_gpus(cfg)
    _check_exist("device.worker_gpus" if cfg.device.worker_gpus else "device.worker_gpu", workers,
                 device_count)
    ranks = int(cfg.local.num_students)
    if not cfg.device.student_gpu:
        return GpuPlacement(workers, ())
    share = bool(cfg.device.share_gpu)
    if cfg.device.student_gpus:
        students = tuple(int(g) for g in cfg.device.student_gpus)
        if len(students) < ranks:
            raise ValueError(f"device.student_gpus={list(students)} names {len(students)} GPU(s) for "
                             f"local.num_students={ranks} ranks: list one per rank")
        students = students[:ranks]
    else:
        free = [g for g in range(device_count) if share or g not in workers]
        if len(free) < ranks:
            raise ValueError(
                f"{ranks} student rank(s) need a GPU each beside the teacher's "
                f"({', '.join(f'cuda:{g}' for g in workers)}), and this machine has {device_count}: "
                "set device.share_gpu=true to let them share (they then compete for memory), "
                "lower local.num_students, or run the teacher elsewhere (device.worker_gpu=null: CPU)")
        students = tuple(free[:ranks])
    _check_exist("device.student_gpus", students, device_count)
    shared = sorted(set(students) & set(workers))
    if shared and not share:
        raise ValueError(f"device.student_gpus={list(students)} puts student ranks on GPU(s) {shared} of the "
                         f"teacher workers ({list(workers)}): pick other GPUs, or set device.share_gpu=true "
                         "to share them on purpose")
    return GpuPlacement(workers, students)


def _check_exist(key: str, gpus: tuple[int, ...], device_count: int) -> None:
    bad = [g for g in gpus if not 0 <= g < device_count]
    if bad:
        raise ValueError(f"{key} names GPU(s) {bad}, but this machine has {device_count} CUDA device(s)"
                         + (": set device=cpu" if device_count == 0 else f" (0..{device_count - 1})"))
