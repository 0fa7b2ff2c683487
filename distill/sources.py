"""Where the teacher, its tokenizer and the token chunks come from, as configured.

Workers and students call the same functions with the same config, so they agree on
the teacher, the tokenizer and the train/held-out split without talking.
"""

from __future__ import annotations

import logging
import os

import torch
from omegaconf import DictConfig

from distill.data import TokenChunks, build_chunks, load_documents
from distill.teacher import Teacher

log = logging.getLogger(__name__)


def teacher_source(cfg: DictConfig) -> str:
    """The directory or hub name of the teacher, building the tiny one on first use."""
    if cfg.teacher.name_or_path:
        return str(cfg.teacher.name_or_path)
    tiny = cfg.teacher.tiny
    if tiny.family == "llama":
        from distill.tiny import tiny_teacher_dir

        kwargs = {"train_steps": tiny.train_steps} if tiny.train_steps is not None else {}
        return tiny_teacher_dir(cfg.teacher.cache_dir, hidden_size=tiny.hidden_size,
                                num_layers=tiny.num_layers, num_heads=tiny.num_heads,
                                seq_len=cfg.data.seq_len, vocab_size=tiny.vocab_size, **kwargs)
    if tiny.family == "bert":
        return tiny_bert_dir(cfg)
    raise ValueError(f"teacher.tiny.family={tiny.family!r}: choose llama or bert")


def load_teacher(cfg: DictConfig, device: str | torch.device = "cpu") -> Teacher:
    return Teacher.from_pretrained(teacher_source(cfg), dtype=cfg.teacher.dtype, device=str(device))


def load_tokenizer(cfg: DictConfig):
    from transformers import AutoTokenizer

    source = teacher_source(cfg)
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ValueError(f"no tokenizer found with teacher.name_or_path={source!r} ({exc}); "
                         "point it at a model directory that has tokenizer files") from None


def load_chunks(cfg: DictConfig, tokenizer=None) -> TokenChunks:
    """Train and held-out token chunks (identical in every process and every run)."""
    data = cfg.data
    docs = load_documents(data.source, path=data.path, dataset_name=data.dataset_name,
                          dataset_config=data.dataset_config, split=data.split,
                          text_field=data.text_field, max_documents=data.max_documents)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    return build_chunks(tokenizer, docs, data.seq_len, data.heldout_fraction, data.seed,
                        max_heldout_chunks=data.max_heldout_chunks)


def tiny_bert_dir(cfg: DictConfig) -> str:
    """A small BERT encoder built from a config (random init, seed 0) + a corpus tokenizer, cached."""
    from transformers import BertConfig, BertModel

    from distill.tiny import _cache_root, _file_lock, train_tokenizer

    tiny = cfg.teacher.tiny
    name = f"tiny-bert-h{tiny.hidden_size}-l{tiny.num_layers}-a{tiny.num_heads}-v{tiny.vocab_size}-t{cfg.data.seq_len}"
    root = _cache_root(cfg.teacher.cache_dir)
    final_dir = os.path.join(root, name)
    if os.path.isdir(final_dir):
        return final_dir
    os.makedirs(root, exist_ok=True)
    with _file_lock(final_dir + ".lock"):
        if os.path.isdir(final_dir):
            return final_dir
        tokenizer = train_tokenizer(load_documents("pydoc"), tiny.vocab_size, cfg.data.seq_len)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = BertModel(BertConfig(
                vocab_size=len(tokenizer), hidden_size=tiny.hidden_size,
                num_hidden_layers=tiny.num_layers, num_attention_heads=tiny.num_heads,
                intermediate_size=4 * tiny.hidden_size, max_position_embeddings=cfg.data.seq_len,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        tmp = final_dir + f".tmp-{os.getpid()}"
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, final_dir)
    return final_dir
