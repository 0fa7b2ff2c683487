"""Where the teacher, its tokenizer and the token chunks come from, as configured.

Workers and students call the same functions with the same config, so they agree on
the teacher, the tokenizer and the train/held-out split without talking. Each takes the
part of the config it reads, and the teacher's source (a directory or hub name) as
:func:`distill.model.location.teacher_source` resolved it once for the process: resolving
it builds the tiny teacher or converts a GGUF file on first use.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoTokenizer

from distill.config import DataConfig, DeviceConfig
from distill.model.data import TokenChunks, build_chunks, load_documents
from distill.model.teacher import Teacher, teacher_device_map

log = logging.getLogger(__name__)


def load_teacher(source: str, dtype: str, device: str | torch.device = "cpu") -> Teacher:
    """The teacher in ``teacher.dtype`` on one device (a student rank's, or the CPU)."""
    return Teacher.from_pretrained(source, dtype=dtype, device=str(device))


def load_worker_teacher(source: str, dtype: str, devices: DeviceConfig) -> Teacher:
    """The teacher as a worker holds it: spread over ``device.worker_gpus`` by a device map (a
    teacher larger than one GPU), else whole on ``device.worker_gpu``, else on the CPU."""
    if devices.worker_gpus:
        return Teacher.from_pretrained(source, dtype=dtype, **teacher_device_map(list(devices.worker_gpus)))
    return load_teacher(source, dtype, worker_device(devices))


def worker_device(devices: DeviceConfig) -> str:
    """The one device of a worker's teacher (``device.worker_gpu``), when it is not spread."""
    return f"cuda:{devices.worker_gpu}" if devices.worker_gpu is not None else "cpu"


def load_tokenizer(source: str):
    """The teacher's tokenizer (every process tokenizes the corpus with it)."""
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ValueError(f"no tokenizer found with teacher.name_or_path={source!r} ({exc}); "
                         "point it at a model directory that has tokenizer files") from None


def load_chunks(data: DataConfig, tokenizer) -> TokenChunks:
    """Train and held-out token chunks (identical in every process and every run)."""
    docs = load_documents(data.source, path=data.path, dataset_name=data.dataset_name,
                          dataset_config=data.dataset_config, split=data.split,
                          text_field=data.text_field, max_documents=data.max_documents)
    return build_chunks(tokenizer, docs, data.seq_len, data.heldout_fraction, data.seed,
                        max_heldout_chunks=data.max_heldout_chunks)
