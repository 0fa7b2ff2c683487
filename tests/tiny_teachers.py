"""Tiny seeded teachers built from configs, shared by the unit tests (no hub)."""

from __future__ import annotations

import torch
import transformers
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


# ---------------------------------------------------------------------- one small teacher per family

DECODER_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "granite", "phi3", "olmo2",
                    "gpt_neox", "gpt2")
ENCODER_FAMILIES = ("bert", "roberta")
SEQ_LEN = 12
"""Tests run chunks of this length: longer than every family's sliding window below."""


def family_config(model_type: str, num_layers: int = 3, vocab_size: int = 96) -> transformers.PretrainedConfig:
    """A small config of ``model_type`` with the family's own features switched on (no hub).

    Mistral and Gemma-2 slide over 4 positions (shorter than ``SEQ_LEN``), Qwen2 mixes
    sliding and full layers, Gemma scales embeddings, Gemma-2 soft-caps logits and
    attention, Gemma-3 keeps a rotary base per layer type, Granite's multipliers are far
    from 1, Phi-3 fuses its projections, OLMo-2 and Qwen3 norm queries and keys, GPT-NeoX
    runs attention and MLP in parallel with rotary on half of each head.
    """
    small = {**_small(vocab_size, num_layers), "max_position_embeddings": 64}
    decoder = {**small, "num_key_value_heads": 2, "tie_word_embeddings": False, "bos_token_id": 1,
               "eos_token_id": 2, "pad_token_id": 0}
    configs = {
        "llama": lambda: transformers.LlamaConfig(**decoder),
        "qwen2": lambda: transformers.Qwen2Config(
            **decoder, use_sliding_window=True, sliding_window=4, max_window_layers=1,
            layer_types=["full_attention"] + ["sliding_attention"] * (num_layers - 1)),
        "qwen3": lambda: transformers.Qwen3Config(**decoder, head_dim=8),
        "mistral": lambda: transformers.MistralConfig(**decoder, sliding_window=4),
        "gemma": lambda: transformers.GemmaConfig(**decoder, head_dim=8),
        "gemma2": lambda: transformers.Gemma2Config(
            **decoder, head_dim=8, sliding_window=4, final_logit_softcapping=3.0,
            attn_logit_softcapping=5.0, query_pre_attn_scalar=6),
        "gemma3_text": lambda: transformers.Gemma3TextConfig(
            **decoder, head_dim=8, sliding_window=4, final_logit_softcapping=3.0, query_pre_attn_scalar=6,
            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2) + ["sliding_attention"] * (num_layers % 2)),
        "granite": lambda: transformers.GraniteConfig(
            **decoder, embedding_multiplier=6.0, logits_scaling=4.0, residual_multiplier=0.3,
            attention_multiplier=0.2),
        "phi3": lambda: transformers.Phi3Config(**decoder, resid_pdrop=0.0,
                                                 embd_pdrop=0.0, attention_dropout=0.0),
        "olmo2": lambda: transformers.Olmo2Config(**decoder),
        "gpt_neox": lambda: transformers.GPTNeoXConfig(
            **{k: v for k, v in decoder.items() if k != "num_key_value_heads"}, rotary_pct=0.5,
            use_parallel_residual=True, hidden_dropout=0.0, attention_dropout=0.0),
        "gpt2": lambda: transformers.GPT2Config(
            vocab_size=vocab_size, n_embd=32, n_layer=num_layers, n_head=4, n_positions=64, initializer_range=0.2,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            tie_word_embeddings=True),
        "bert": lambda: transformers.BertConfig(**small, hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0),
        "roberta": lambda: transformers.RobertaConfig(**small, pad_token_id=1, hidden_dropout_prob=0.0,
                                                      attention_probs_dropout_prob=0.0),
    }
    return configs[model_type]()


def family_model(model_type: str, num_layers: int = 3, vocab_size: int = 96) -> transformers.PreTrainedModel:
    """A seeded random model of ``model_type``: a causal LM for decoders, the bare encoder otherwise."""
    torch.manual_seed(0)
    config = family_config(model_type, num_layers, vocab_size)
    model_cls = transformers.AutoModel if model_type in ENCODER_FAMILIES else transformers.AutoModelForCausalLM
    return model_cls.from_config(config).eval()
