"""Tiny seeded teachers built from configs, shared by the unit tests (no hub)."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

from distill.model.teacher import Teacher


def _small(vocab_size: int, num_layers: int) -> dict:
    return {
        "vocab_size": vocab_size,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "initializer_range": 0.2,  # large weights: every layer matters to the output
    }


def tiny_llama(vocab_size: int, num_layers: int, tie: bool = False) -> Teacher:
    torch.manual_seed(0)
    config = LlamaConfig(**_small(vocab_size, num_layers), num_key_value_heads=2, tie_word_embeddings=tie)
    return Teacher(LlamaForCausalLM(config))


def tiny_bert(vocab_size: int, num_layers: int) -> Teacher:
    torch.manual_seed(0)
    config = BertConfig(**_small(vocab_size, num_layers), max_position_embeddings=64,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return Teacher(BertModel(config))
