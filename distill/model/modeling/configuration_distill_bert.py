"""DistillBertConfig: the configuration of a distilled encoder student (``model_type: distill_bert``).

This file is copied verbatim into every exported encoder student, next to
``modeling_distill_bert.py``, and named in ``config.json``'s ``auto_map``; it imports
transformers only, so ``AutoConfig.from_pretrained(dir, trust_remote_code=True)`` reads a
student without the tool that made it.

A student's config is its teacher's config (a BERT-family encoder, every key at the top
level as in the teacher's own ``config.json``) plus what makes it a student:

    teacher_model_type   the teacher's ``model_type`` ("bert", ...)
    teacher_classes      the teacher's classes, by dotted path inside ``transformers.models``:
                         {"embeddings": ..., "layer": ..., "pooler": ... (absent: no pooler)}
    distill_layers       {"<layer index>": {"kind": ..., <options>}} for every replaced layer;
                         kinds and their options are listed in ``LAYER_KINDS``
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

LAYER_KINDS: dict[str, tuple[str, ...]] = {
    "copy": (),
    "pruned": ("config_overrides",),
    "lowrank": ("ranks",),
    "mlp": ("hidden_units", "activation", "norm", "norm_eps"),
    "linear_attention": ("feature_map", "feature_dim", "chunk_size"),
    "sliding_window_linear": ("feature_map", "feature_dim", "chunk_size", "window"),
    "gated_linear_attention": ("feature_map", "feature_dim", "chunk_size"),
}
"""Kind of a replaced layer -> the keys its entry in ``distill_layers`` must carry."""


class DistillBertConfig(PreTrainedConfig):
    """The teacher encoder's config plus the replaced layers (see the module docstring)."""

    model_type = "distill_bert"

    def __init__(
        self,
        teacher_model_type: str = "bert",
        teacher_classes: dict[str, str] | None = None,
        distill_layers: dict[str, dict[str, Any]] | None = None,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> None:
        self.use_cache = use_cache  # transformers 5 keeps it per model config, not in the base class
        self.teacher_model_type = teacher_model_type
        self.teacher_classes = dict(teacher_classes or {})
        self.distill_layers = {str(idx): dict(spec) for idx, spec in (distill_layers or {}).items()}
        super().__init__(**kwargs)
        _check(self)


def _check(config: DistillBertConfig) -> None:
    """Refuse a config whose replaced layers this modeling code cannot build, saying why."""
    num_layers = getattr(config, "num_hidden_layers", 0)
    for idx, spec in config.distill_layers.items():
        kind = spec.get("kind")
        if kind not in LAYER_KINDS:
            raise ValueError(
                f"distill_bert config: layer {idx} has kind {kind!r}, which this modeling code does "
                f"not know (it knows {sorted(LAYER_KINDS)}); load it with the modeling files it was "
                "exported with."
            )
        missing = [key for key in LAYER_KINDS[kind] if key not in spec]
        if missing or not 0 <= int(idx) < num_layers:
            raise ValueError(
                f"distill_bert config: layer {idx} ({kind}) is out of range or lacks {missing}; "
                "re-export the student."
            )
    for role, path in config.teacher_classes.items():
        if not str(path).startswith("transformers.models."):
            raise ValueError(
                f"distill_bert config: teacher_classes[{role!r}]={path!r} must name a class inside "
                "transformers.models; this config was not written by distill."
            )


__all__ = ["DistillBertConfig"]
