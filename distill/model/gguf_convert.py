"""A GGUF file turned into an ordinary HF directory: float32 weights, config, tokenizer.

transformers reads the file (``gguf_file=``), dequantizing every weight to float32, but the
model it returns carries a GGUF ``quantization_config`` and refuses ``save_pretrained``. So the
model is rebuilt from the file's config without the keys that describe the file
(``gguf_cache.gguf_config``), on the meta device (no random initialisation), given the
dequantized weights, and saved; the tokenizer the file describes is saved beside it. What
reads the directory afterwards (workers, students, the export) sees an HF teacher like any
other, and ``teacher.dtype`` applies when it is loaded, as for any other.
``distill.model.gguf_cache`` decides when this runs (once per file).
"""

from __future__ import annotations

import logging
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PretrainedConfig

log = logging.getLogger(__name__)


def convert(gguf_path: str, config: PretrainedConfig, out_dir: str) -> None:
    """Write the model and tokenizer ``gguf_path`` holds to ``out_dir`` as an HF directory, the
    model built from ``config`` (the file's, as ``gguf_cache.gguf_config`` reads it)."""
    started = time.monotonic()
    directory, name = os.path.split(os.path.abspath(gguf_path))
    log.info("converting the GGUF teacher %s to an HF directory (once per file)", gguf_path)
    loaded = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True),
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(directory, gguf_file=name).save_pretrained(out_dir)
    log.info("converted %s in %.1fs", gguf_path, time.monotonic() - started)
