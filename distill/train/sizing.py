"""How big a run is, before it starts: the formulas of docs/scale.md in one place.

What a worker writes per sample is fixed by the stage layout (:mod:`distill.stages`):
token ids and a few boundary hidden states, plus the teacher's top-k when the end-to-end
stage is on. Everything that scales with the teacher follows from that and from its
shape: shared memory per student, bytes over the network medium, what storing the same
targets on disk would take, the teacher and student rates of a stage, and the memory
floor of a student rank. The start-up checks (``distill.modes.checks``) refuse a run
these numbers say cannot fit; ``bench/scale.py`` tabulates them for 8B and 70B teachers
and checks them against a measured run on this machine; tests hold them equal to the
layout the pipeline really allocates.

Symbols: T tokens per sample, D hidden size, P boundary states per sample, b bytes per
element of teacher.dtype, K top-k, L teacher layers, V vocabulary, N parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from distill.config import Dtype, Trainable
from distill.pipeline import slot
from distill.pipeline.slot import slot_stride

DTYPE_BYTES: dict[str, int] = {Dtype.float32: 4, Dtype.bfloat16: 2, Dtype.float16: 2}
TOKEN_ID_BYTES = 8
"""int64 token ids."""
TOPK_BYTES = 4 + 8
"""Per token and k: a float32 log-probability and an int64 token id."""
ADAMW_BYTES_PER_PARAM = 4 + 4 + 8
"""A float32 trained parameter, its gradient and AdamW's two moments."""
LOSS_BUFFERS = 4
"""[chunk, V] float32 buffers alive at once in the chunked KL (logits, log-softmax, their
gradients), a floor: distill.train.e2e.chunked_topk_kl."""


def state_bytes_per_token(hidden_size: int, dtype: str) -> int:
    """One boundary hidden state of one token: D * b."""
    return hidden_size * DTYPE_BYTES[dtype]


def sample_bytes(seq_len: int, hidden_size: int, dtype: str, positions: int, top_k: int = 0) -> int:
    """One sample's payload: T * (8 + P * D * b + K * 12) (= ``stage_layout``'s BatchConfig)."""
    return seq_len * (TOKEN_ID_BYTES + positions * state_bytes_per_token(hidden_size, dtype) + top_k * TOPK_BYTES)


def segment_bytes(sample: int, slots: int) -> int:
    """One shared-memory segment of ``slots`` slots (header + payload, aligned) and the
    segment header behind them (``distill.pipeline.slot.segment_bytes``, the one formula)."""
    return slot.segment_bytes(slots, slot_stride(sample))


def shm_bytes(sample: int, slot_count: int, loader_workers: int = 0, ranks: int = 1) -> int:
    """/dev/shm the student ranks of one machine allocate: per rank, a segment of
    ``slot_count`` slots per loader process (the training process when there is none), and
    the one-slot segment of its control client (``distill.transport.control_client``)."""
    return ranks * (max(1, loader_workers) * segment_bytes(sample, slot_count) + segment_bytes(sample, 1))


def network_bytes_per_s(samples_per_s: float, sample: int) -> float:
    """What the network medium carries to one student at its rate: each sample travels as one
    slot (header + payload, aligned: ``slot_stride``), the rest is framing and control."""
    return samples_per_s * slot_stride(sample)


def disk_bytes(tokens: int, hidden_size: int, dtype: str, num_layers: int) -> int:
    """Writing the same targets to disk instead: every boundary state (L + 1 per token) of
    ``tokens`` tokens once, so that every layer stage can read its own."""
    return tokens * (num_layers + 1) * state_bytes_per_token(hidden_size, dtype)


@dataclass(frozen=True)
class ModelShape:
    """A teacher's shape, from its config.json, enough to count parameters and FLOPs."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    mlp_matrices: int = 3
    """3 for gated MLPs (Llama family), 2 for BERT."""
    tied: bool = False

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(vocab_size=int(config["vocab_size"]), hidden_size=hidden,
                   num_layers=int(config["num_hidden_layers"]), num_heads=heads,
                   num_kv_heads=int(config.get("num_key_value_heads") or heads),
                   head_dim=int(config.get("head_dim") or hidden // heads),
                   intermediate_size=int(config["intermediate_size"]),
                   mlp_matrices=2 if config.get("model_type") == "bert" else 3,
                   tied=bool(config.get("tie_word_embeddings", False)))

    @property
    def layer_params(self) -> int:
        """Weights of one layer's matmuls: q and o, k and v (grouped), the MLP (norms left out)."""
        attention = 2 * self.hidden_size * self.num_heads * self.head_dim
        attention += 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return attention + self.mlp_matrices * self.hidden_size * self.intermediate_size

    @property
    def params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tied else 2)
        return embeddings + self.num_layers * self.layer_params

    def layer_flops_per_token(self, seq_len: int) -> int:
        """Forward FLOPs per token of one layer, counted as Teacher.layer_flops_per_token does."""
        return 2 * self.layer_params + 4 * seq_len * self.num_heads * self.head_dim


def teacher_samples_per_s(shape: ModelShape, layer_idx: int, seq_len: int, flops_per_s: float) -> float:
    """Samples/s one teacher device delivers for a stage training layer ``layer_idx``: its
    forward stops after that layer, so it runs layer_idx + 1 layers."""
    return flops_per_s / (seq_len * (layer_idx + 1) * shape.layer_flops_per_token(seq_len))


def student_samples_per_s(replacement_flops_per_token: float, seq_len: int, flops_per_s: float) -> float:
    """Samples/s one student device trains a replacement at (forward + backward = 3 forwards)."""
    return flops_per_s / (3 * seq_len * replacement_flops_per_token)


def e2e_rank_floor(shape: ModelShape, dtype: str, trainable: str, world_size: int, sharded: bool,
                   loss_chunk_tokens: int) -> dict[str, int]:
    """A floor of one student rank's memory in the end-to-end stage, by part: the teacher it
    holds (once), with trainable=all the trained float32 copy with gradients and AdamW state
    (1/world of it under FSDP2), and the chunked loss's buffers. Activations and the
    replacements' own weights come on top (they depend on the batch and the replacement)."""
    parts = {"teacher": shape.params * DTYPE_BYTES[dtype],
             "loss chunks": LOSS_BUFFERS * loss_chunk_tokens * shape.vocab_size * 4}
    if trainable == Trainable.all:
        parts["trained copy, gradients, AdamW"] = shape.params * ADAMW_BYTES_PER_PARAM // (
            world_size if sharded else 1)
    return parts
