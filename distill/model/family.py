"""What each HuggingFace family's forward does around and between its layers: one adapter per family.

A teacher is only as right as distill's idea of its forward. Families differ in small
ways that change every number when dropped: Gemma scales its embeddings by sqrt(hidden),
Granite multiplies embeddings and residuals and divides its logits, Gemma-2 soft-caps its
logits and needs eager attention, Mistral's layers all slide over a window that no layer
attribute names. Every consumer (the teacher runner, the replacements, the pre-flight
checks, the exported student's config) asks the :class:`Family` of the teacher's
``config.model_type``; nothing else branches on a family's name.

A ``model_type`` missing here, or a replacement kind a family cannot take, is refused by
:func:`check_teacher` before any process starts, with a message naming the feature and
what to choose instead.

This module reads configs only (a ``config.json`` dict or a ``PretrainedConfig``), so the
start-up checks can use it without importing transformers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

LINEAR_KINDS = ("linear_attention", "sliding_window_linear", "gated_linear_attention", "gated_delta_rule")
"""Replacement kinds that rebuild the teacher layer around a new attention (`LinearAttentionBlock`)."""


@dataclass(frozen=True)
class Family:
    """One family's forward, as far as a layer-by-layer student needs it.

    ``modeling`` names the exported student's modeling files (``distill_llama``: decoders
    whose layers take rotary ``position_embeddings``; ``distill_bert``: BERT-style encoders).
    """

    name: str
    """The family's ``model_type`` (the key of ``FAMILIES``)."""
    modeling: str
    """"llama" (pre-norm decoders, exported as ``distill_llama``) or "bert" (encoders, ``distill_bert``)."""
    layers_path: str
    """Where the layer list sits in the base model ("layers", "encoder.layer")."""
    final_norm: str | None = "norm"
    """The base model's norm after the last layer; None where layers end in their own norm."""
    embed_name: str = "embed_tokens"
    """The base model's token embedding (the student always calls its own ``embed_tokens``)."""
    rotary: bool = True
    """Whether the base model keeps a ``rotary_emb`` its layers take ``position_embeddings`` from."""
    learned_positions: str | None = None
    """The base model's learned absolute position embedding, added to the token embeddings (GPT-2's ``wpe``)."""
    embedding_scale: str | None = None
    """How embeddings are scaled: None, "sqrt_hidden" (Gemma, in the weights' dtype) or a config key (Granite's ``embedding_multiplier``)."""
    logits_divisor_key: str | None = None
    """Config key the logits are divided by (Granite's ``logits_scaling``)."""
    logits_softcap_key: str | None = None
    """Config key of the final logit soft-cap ``cap * tanh(logits / cap)`` (Gemma-2)."""
    refused_kinds: Mapping[str, str] = field(default_factory=dict)
    """Replacement kind -> the feature of this family's layers that kind cannot reproduce."""
    refused_options: Mapping[str, str] = field(default_factory=dict)
    """``"<kind>.<option>"`` -> the feature that option cannot be used with (when it is set, not null)."""


def _linear_refused(feature: str) -> dict[str, str]:
    return dict.fromkeys(LINEAR_KINDS, feature)


_DECODER = {"modeling": "llama", "layers_path": "layers"}
_CAUSAL_ONLY = {"gated_delta_rule": "attention in both directions, which the delta rule's state (written "
                                    "position after position) cannot give; gated_linear_attention decays by "
                                    "distance both ways"}
_ENCODER = {"modeling": "bert", "layers_path": "encoder.layer", "final_norm": None}

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("llama", **_DECODER),
        Family("qwen2", **_DECODER),
        Family("qwen3", **_DECODER),
        Family("mistral", **_DECODER),
        Family("gemma", **_DECODER, embedding_scale="sqrt_hidden"),
        Family(
            "gemma2", **_DECODER, embedding_scale="sqrt_hidden", logits_softcap_key="final_logit_softcapping",
            refused_kinds=_linear_refused("norms after attention and MLP, attention logit soft-capping and "
                                          "query_pre_attn_scalar"),
        ),
        Family(
            "gemma3_text", **_DECODER, embedding_scale="sqrt_hidden", logits_softcap_key="final_logit_softcapping",
            refused_kinds=_linear_refused("norms after attention and MLP, q/k norms and rotary embeddings per "
                                          "layer type"),
        ),
        Family(
            "granite", **_DECODER, embedding_scale="embedding_multiplier", logits_divisor_key="logits_scaling",
            refused_kinds=_linear_refused("residual_multiplier and attention_multiplier"),
        ),
        Family(
            "gpt_neox", **_DECODER, final_norm="final_layer_norm", embed_name="embed_in",
            refused_kinds={
                **_linear_refused("parallel residual attention and MLP and a fused query_key_value"),
                "pruned": "fused query_key_value and an MLP of dense_h_to_4h / dense_4h_to_h",
            },
        ),
        Family(
            "gpt2", modeling="llama", layers_path="h", final_norm="ln_f", embed_name="wte", rotary=False,
            learned_positions="wpe",
            refused_kinds={
                **_linear_refused("learned absolute positions (no rotary) and Conv1D projections"),
                "pruned": "Conv1D projections and a fused c_attn",
                "lowrank": "Conv1D projections (lowrank factorises nn.Linear maps)",
            },
        ),
        Family(
            "phi3", **_DECODER,
            refused_kinds={
                **_linear_refused("fused qkv_proj"),
                "pruned": "fused gate_up_proj and qkv_proj",
            },
        ),
        Family(
            "olmo2", **_DECODER,
            refused_kinds=_linear_refused("norms after attention and MLP (no norm before them) and q/k norms "
                                          "over all heads"),
            refused_options={"pruned.num_key_value_heads": "q/k norms over all heads together, which "
                                                            "pruning KV heads would have to cut too"},
        ),
        Family("bert", **_ENCODER, refused_kinds=_CAUSAL_ONLY),
        Family("roberta", **_ENCODER, refused_kinds=_CAUSAL_ONLY),
    )
}
"""Every supported family by ``model_type``. Each entry is held by tests/unit/model/test_family.py:
a teacher run layer by layer equals HF's own forward, and a copy student exported and loaded
through the Auto classes equals the teacher."""

NOT_SUPPORTED: dict[str, str] = {
    "gptj": "parallel residual attention+MLP",
    "falcon": "parallel residual attention+MLP and fused projections",
    "phi": "parallel residual attention+MLP and partial rotary",
    "modernbert": "an encoder with alternating local/global rotary attention",
    "gemma3": "vision tower and multimodal wrapper (load the text model: Gemma3ForCausalLM, model_type gemma3_text)",
    "cohere": "parallel residual attention+MLP and a logit_scale",
    "mixtral": "mixture-of-experts MLPs",
    "qwen2_moe": "mixture-of-experts MLPs",
}
"""Known families distill cannot yet reproduce exactly, with the feature that stands in the way."""


def config_value(config: Mapping[str, Any] | Any, key: str, default: Any = None) -> Any:
    """``config[key]`` of a ``config.json`` dict or ``getattr`` of a ``PretrainedConfig``."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def detect(config: Mapping[str, Any] | Any) -> Family:
    """The family of a teacher config, by its ``model_type``; a ValueError naming what to choose otherwise."""
    model_type = config_value(config, "model_type")
    family = FAMILIES.get(model_type)
    if family is not None:
        return family
    why = NOT_SUPPORTED.get(model_type)
    reason = f"its {why} are not reproduced by distill yet" if why else "distill has no adapter for it"
    raise ValueError(
        f"Unsupported teacher family model_type={model_type!r}: {reason}. Supported families: "
        f"{', '.join(sorted(FAMILIES))}. Choose a teacher of one of them (`teacher.name_or_path`)."
    )


def check_kind(family: Family, kind: str, options: Mapping[str, Any] | None = None) -> None:
    """Refuse a replacement kind (or a set option of it) the family's layers cannot take, naming
    the feature and what works instead."""
    for key, feature in family.refused_options.items():
        refused_kind, _, option = key.partition(".")
        if refused_kind == kind and (options or {}).get(option) is not None:
            raise ValueError(
                f"replacement.{option} cannot be used with the {family.name} teacher: {feature}. "
                f"Set replacement.{option}=null, or choose another replacement."
            )
    feature = family.refused_kinds.get(kind)
    if feature is None:
        return
    working = [k for k in KINDS if k not in family.refused_kinds]
    raise ValueError(
        f"replacement={kind} cannot reproduce the {family.name} teacher's layers: {feature}. "
        f"Choose one of replacement={', '.join(working)} for this teacher."
    )


KIND_OF_TARGET: dict[str, str] = {
    "distill.replacements.linear_attention.LinearAttentionLayer": "linear_attention",
    "distill.replacements.sliding_window_linear.SlidingWindowLinearLayer": "sliding_window_linear",
    "distill.replacements.gated_linear_attention.GatedLinearAttentionLayer": "gated_linear_attention",
    "distill.replacements.gated_delta_rule.GatedDeltaRuleLayer": "gated_delta_rule",
    "distill.replacements.mlp.ResidualMLP": "mlp",
    "distill.replacements.pruned.PrunedLayer": "pruned",
    "distill.replacements.lowrank.LowRankLayer": "lowrank",
    "distill.replacements.teacher_copy.TeacherCopy": "copy",
}
"""``replacement._target_`` -> its kind (the option of ``conf/replacement``); a test holds it to conf/."""

KINDS = tuple(KIND_OF_TARGET.values())
"""Every replacement kind, for the messages above."""


def check_teacher(config: Mapping[str, Any] | Any, kind: str | None,
                  options: Mapping[str, Any] | None = None) -> Family:
    """The family of ``config``, refusing an unsupported family, ``kind`` or option (before any process starts)."""
    family = detect(config)
    if kind is not None:
        check_kind(family, kind, options)
    return family


def embedding_scale(family: Family, config: Mapping[str, Any] | Any) -> dict[str, Any] | None:
    """How the student scales its embeddings, as the exported config's ``distill_embedding`` records it.

    ``{"scale": s, "in_weight_dtype": bool, "on_inputs_embeds": bool}``: Gemma multiplies the
    embedding lookup by sqrt(hidden) rounded to the weights' dtype, inside its embedding module
    (so ``inputs_embeds`` a caller gives are not scaled); Granite multiplies whatever enters the
    first layer by a Python float. None when the family does not scale.
    """
    if family.embedding_scale is None:
        return None
    if family.embedding_scale == "sqrt_hidden":
        scale = math.sqrt(float(config_value(config, "hidden_size")))
        return {"scale": scale, "in_weight_dtype": True, "on_inputs_embeds": False}
    return {"scale": float(config_value(config, family.embedding_scale, 1.0)), "in_weight_dtype": False,
            "on_inputs_embeds": True}


def logits_transform(family: Family, config: Mapping[str, Any] | Any) -> dict[str, float | None]:
    """What the family does to the LM head's output: ``{"divisor": d or None, "softcap": c or None}``."""
    divisor = config_value(config, family.logits_divisor_key) if family.logits_divisor_key else None
    softcap = config_value(config, family.logits_softcap_key) if family.logits_softcap_key else None
    return {"divisor": None if divisor is None else float(divisor),
            "softcap": None if softcap is None else float(softcap)}
