"""Stages: which teacher layers are trained together, and what a sample of a stage holds.

A stage trains ``layers_per_stage`` layers from one teacher pass. A sample holds the
token ids and the hidden states at the stage's *boundaries*: position p is the input
of layer p (= the output of layer p-1). For consecutive layers l..l+k-1 that is k+1
states instead of 2k; each replacement still sees the teacher's own input.

The payload layout is fixed for a whole run (the largest stage), so a student's
slots never need resizing between stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from distill.pipeline import BatchConfig, TensorSpec


@dataclass(frozen=True)
class Stage:
    index: int
    layers: tuple[int, ...]

    @property
    def positions(self) -> tuple[int, ...]:
        """Boundary positions whose hidden states a sample carries, ascending."""
        return tuple(sorted({p for layer in self.layers for p in (layer, layer + 1)}))

    @property
    def model_id(self) -> str:
        return f"stage{self.index}:layers" + ",".join(map(str, self.layers))

    @property
    def model_cfg(self) -> dict:
        return {"stage": self.index, "layers": list(self.layers)}

    def io_index(self, layer: int) -> tuple[int, int]:
        """Indices into the sample's ``hidden`` of layer's input and output."""
        return self.positions.index(layer), self.positions.index(layer + 1)


def plan_stages(num_layers: int, layers: list[int] | None, layers_per_stage: int) -> list[Stage]:
    """Split the layers to replace into stages of ``layers_per_stage``."""
    chosen = sorted(set(range(num_layers) if layers is None else layers))
    bad = [layer for layer in chosen if not 0 <= layer < num_layers]
    if bad:
        raise ValueError(f"student.layers has {bad}, outside the teacher's layers 0..{num_layers - 1}; "
                         "fix student.layers or leave it null for all layers")
    if layers_per_stage < 1:
        raise ValueError(f"student.layers_per_stage={layers_per_stage} must be >= 1")
    if not chosen:
        raise ValueError("student.layers is empty: name at least one layer, or null for all")
    groups = [chosen[i:i + layers_per_stage] for i in range(0, len(chosen), layers_per_stage)]
    return [Stage(i, tuple(group)) for i, group in enumerate(groups)]


def max_positions(stages: list[Stage]) -> int:
    return max(len(stage.positions) for stage in stages)


def sample_batch_config(num_positions: int, seq_len: int, hidden_size: int, dtype: str) -> BatchConfig:
    """The layout of one sample: token ids + ``num_positions`` hidden states."""
    return BatchConfig([
        TensorSpec("input_ids", (seq_len,), "int64"),
        TensorSpec("hidden", (num_positions, seq_len, hidden_size), dtype),
    ])
