"""Where the teacher, its tokenizer and the token chunks come from, as configured.

Workers and students call the same functions with the same config, so they agree on
the teacher, the tokenizer and the train/held-out split without talking.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoTokenizer

from distill.config import Config
from distill.model.data import TokenChunks, build_chunks, load_documents
from distill.model.location import teacher_source
from distill.model.teacher import Teacher, teacher_device_map

log = logging.getLogger(__name__)


def load_teacher(cfg: Config, device: str | torch.device = "cpu") -> Teacher:
    return Teacher.from_pretrained(teacher_source(cfg), dtype=cfg.teacher.dtype, device=str(device))


def load_worker_teacher(cfg: Config) -> Teacher:
    """The teacher as a worker holds it: spread over ``device.worker_gpus`` by a device map (a
    teacher larger than one GPU), else whole on ``device.worker_gpu``, else on the CPU."""
    gpus = cfg.device.worker_gpus
    if gpus:
        return Teacher.from_pretrained(teacher_source(cfg), dtype=cfg.teacher.dtype,
                                       **teacher_device_map(list(gpus)))
    return load_teacher(cfg, worker_device(cfg))


def worker_device(cfg: Config) -> str:
    """The one device of a worker's teacher (``device.worker_gpu``), when it is not spread."""
    return f"cuda:{cfg.device.worker_gpu}" if cfg.device.worker_gpu is not None else "cpu"


def load_tokenizer(cfg: Config):
    source = teacher_source(cfg)
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ValueError(f"no tokenizer found with teacher.name_or_path={source!r} ({exc}); "
                         "point it at a model directory that has tokenizer files") from None


def load_chunks(cfg: Config, tokenizer=None) -> TokenChunks:
    """Train and held-out token chunks (identical in every process and every run)."""
    data = cfg.data
    docs = load_documents(data.source, path=data.path, dataset_name=data.dataset_name,
                          dataset_config=data.dataset_config, split=data.split,
                          text_field=data.text_field, max_documents=data.max_documents)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    return build_chunks(tokenizer, docs, data.seq_len, data.heldout_fraction, data.seed,
                        max_heldout_chunks=data.max_heldout_chunks)
