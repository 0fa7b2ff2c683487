"""DistillLlamaConfig: the configuration of a distilled decoder student (``model_type: distill_llama``).

This file is copied verbatim into every exported decoder student, next to
``modeling_distill_llama.py``, and named in ``config.json``'s ``auto_map``; it imports
transformers only, so ``AutoConfig.from_pretrained(dir, trust_remote_code=True)`` reads a
student without the tool that made it.

A student's config is its teacher's config (a Llama, Qwen2, Mistral or Qwen3 decoder, every
key at the top level as in the teacher's own ``config.json``) plus what makes it a student:

    teacher_model_type   the teacher's ``model_type`` ("llama", "qwen2", ...)
    teacher_classes      the teacher's classes, by dotted path inside ``transformers.models``:
                         {"layer": decoder layer, "norm": RMSNorm, "rotary": rotary embedding}
    teacher_layer_types  the teacher's attention type of each layer ("full_attention" or
                         "sliding_attention"), which layers kept from it still use
    distill_layers       {"<layer index>": {"kind": ..., <options>}} for every replaced layer;
                         kinds and their options are listed in ``LAYER_KINDS``
    layer_types          the cache layer each layer's decode state needs (see
                         ``modeling_distill_llama``); derived from the two above when absent
    distill_embedding    how the teacher scales its embeddings, or null: ``{"scale", "in_weight_dtype",
                         "on_inputs_embeds"}`` (Gemma: sqrt(hidden) in the weights' dtype, inside
                         the lookup; Granite: ``embedding_multiplier`` on whatever enters layer 0)
    distill_logits       what the teacher does to the LM head's output: ``{"divisor", "softcap"}``
                         (Granite's ``logits_scaling``, Gemma-2's ``final_logit_softcapping``)
    distill_learned_positions
                         the size of the teacher's learned position embedding (GPT-2's ``wpe``, added
                         to the token embeddings; such teachers have no rotary embedding), or null
    teacher_norm_eps     the epsilon of the teacher's final norm (``rms_norm_eps`` or ``layer_norm_eps``
                         in the teacher's own config)
    teacher_attn_implementation
                         the teacher's attention implementation; the student loads with it unless
                         the caller chooses another (Gemma-2's soft-capped attention needs "eager")
    sliding_window       the teacher's key, which transformers sizes every KV ring by: with
                         sliding-window + linear attention layers, their largest window unless
                         a teacher layer with a window of its own still runs
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
    "gated_delta_rule": ("chunk_size", "gate_init", "beta_init"),
}
"""Kind of a replaced layer -> the keys its entry in ``distill_layers`` must carry."""

RECURRENT_LAYER_TYPE = "linear_attention"
"""Cache layer type of replaced layers that keep no KV cache (a fixed-size state, or none):
transformers' own ``LinearAttentionLayer``. A standard type, so that transformers' config
checks (run by ``save_pretrained`` and by ``AutoTokenizer`` on any config) accept it."""

HYBRID_LAYER_TYPE = "hybrid_sliding"
"""Cache layer type of sliding-window + linear attention layers: transformers'
``LinearAttentionAndSlidingWindowAttentionLayer``, a KV ring of ``sliding_window - 1`` positions
plus a linear state."""

KV_KINDS = ("copy", "pruned", "lowrank")
"""Kinds that run the teacher's own attention and so keep a KV cache of the teacher's type."""

WINDOW_KINDS = ("sliding_window_linear",)
"""Kinds whose cache layer is a ``hybrid_sliding`` ring sized by ``sliding_window``."""

SLIDING_TEACHER_TYPES = ("sliding_attention", "chunked_attention")
"""Teacher attention types whose KV cache is a ring sized by ``sliding_window`` too."""


class DistillLlamaConfig(PreTrainedConfig):
    """The teacher decoder's config plus the replaced layers (see the module docstring)."""

    model_type = "distill_llama"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        teacher_model_type: str = "llama",
        teacher_classes: dict[str, str] | None = None,
        teacher_layer_types: list[str] | None = None,
        distill_layers: dict[str, dict[str, Any]] | None = None,
        layer_types: list[str] | None = None,
        distill_embedding: dict[str, Any] | None = None,
        distill_logits: dict[str, Any] | None = None,
        teacher_attn_implementation: str | None = None,
        teacher_norm_eps: float | None = None,
        distill_learned_positions: int | None = None,
        use_cache: bool = True,
        **kwargs: Any,
    ) -> None:
        self.use_cache = use_cache  # transformers 5 keeps it per model config, not in the base class
        self.teacher_model_type = teacher_model_type
        self.distill_embedding = dict(distill_embedding) if distill_embedding else None
        self.distill_logits = dict(distill_logits or {"divisor": None, "softcap": None})
        self.teacher_attn_implementation = teacher_attn_implementation
        self.teacher_norm_eps = teacher_norm_eps
        self.distill_learned_positions = distill_learned_positions
        if teacher_attn_implementation and kwargs.get("attn_implementation") is None:
            kwargs["attn_implementation"] = teacher_attn_implementation
        self.teacher_classes = dict(teacher_classes or {})
        self.distill_layers = {str(idx): dict(spec) for idx, spec in (distill_layers or {}).items()}
        super().__init__(**kwargs)
        num_layers = getattr(self, "num_hidden_layers", 0)
        self.teacher_layer_types = list(teacher_layer_types or ["full_attention"] * num_layers)
        self.layer_types = list(layer_types or _cache_layer_types(self))
        _check(self)
        _size_rings(self)


def _cache_layer_types(config: DistillLlamaConfig) -> list[str]:
    """Per layer: the teacher's type where the teacher's attention runs, else the kind's state type."""
    types = []
    for idx, teacher_type in enumerate(config.teacher_layer_types):
        spec = config.distill_layers.get(str(idx))
        if spec is None or spec["kind"] in KV_KINDS:
            types.append(teacher_type)
        else:
            types.append(HYBRID_LAYER_TYPE if spec["kind"] in WINDOW_KINDS else RECURRENT_LAYER_TYPE)
    return types


def _size_rings(config: DistillLlamaConfig) -> None:
    """Make ``sliding_window`` hold the window layers' KV rings (transformers sizes every ring from it).

    Where no teacher attention with a window of its own runs, it becomes the largest window
    (at least 2: the ring keeps ``sliding_window - 1`` positions). Where one does (a Mistral
    layer kept), it stays the teacher's and must be at least every window: the ring then holds
    more positions than the window reads.
    """
    windows = [int(spec["window"]) for spec in config.distill_layers.values() if spec["kind"] in WINDOW_KINDS]
    if not windows:
        return
    teacher_rings = [
        teacher_type for idx, teacher_type in enumerate(config.teacher_layer_types)
        if teacher_type in SLIDING_TEACHER_TYPES
        and config.distill_layers.get(str(idx), {"kind": "copy"})["kind"] in KV_KINDS
    ]
    if not teacher_rings:
        config.sliding_window = max(2, *windows)
        return
    ring = getattr(config, "sliding_window", None)
    if ring is None or ring < max(windows):
        raise ValueError(
            f"distill_llama config: a window of {max(windows)} positions does not fit the KV ring of "
            f"sliding_window={ring} that the teacher's own sliding-window layers share with it; use "
            f"replacement.window <= {ring}, or replace those layers too."
        )


def _check(config: DistillLlamaConfig) -> None:
    """Refuse a config whose replaced layers this modeling code cannot build, saying why."""
    num_layers = getattr(config, "num_hidden_layers", 0)
    if len(config.teacher_layer_types) != num_layers or len(config.layer_types) != num_layers:
        raise ValueError(
            f"distill_llama config: teacher_layer_types and layer_types need one entry per layer "
            f"({num_layers}); re-export the student."
        )
    for idx, spec in config.distill_layers.items():
        kind = spec.get("kind")
        if kind not in LAYER_KINDS:
            raise ValueError(
                f"distill_llama config: layer {idx} has kind {kind!r}, which this modeling code does "
                f"not know (it knows {sorted(LAYER_KINDS)}); load it with the modeling files it was "
                "exported with."
            )
        missing = [key for key in LAYER_KINDS[kind] if key not in spec]
        if missing or not 0 <= int(idx) < num_layers:
            raise ValueError(
                f"distill_llama config: layer {idx} ({kind}) is out of range or lacks {missing}; "
                "re-export the student."
            )
    for role, path in config.teacher_classes.items():
        if not str(path).startswith(("transformers.models.", "torch.nn.modules.")):
            raise ValueError(
                f"distill_llama config: teacher_classes[{role!r}]={path!r} must name a class inside "
                "transformers.models (or torch.nn); this config was not written by distill."
            )


__all__ = ["DistillLlamaConfig"]
