"""The HF-native student: a teacher's config and weights turned into ``distill_llama`` / ``distill_bert``.

The modeling code lives in :mod:`distill.model.modeling` (self-contained, copied into every
export); this module is distill's side of it: the student's config from a :class:`Teacher`
and the replacements' specs (:func:`student_config`, which the replacements use too), the
student's weights under the names of that modeling code (:func:`native_state`), writing a
directory that ``AutoModel*.from_pretrained(dir, trust_remote_code=True)`` loads
(:func:`write_native`), and loading one strictly (:func:`load_native`, :func:`build_native`).

Shape legend: D hidden size, V vocabulary.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
import transformers
from torch import nn
from transformers.cache_utils import get_layer_types_and_kwargs

from distill.model import family as families
from distill.model.modeling import modeling_distill_bert, modeling_distill_llama
from distill.model.modeling.configuration_distill_bert import DistillBertConfig
from distill.model.modeling.configuration_distill_llama import DistillLlamaConfig
from distill.model.teacher import Teacher

log = logging.getLogger(__name__)

MODELING_DIR = Path(modeling_distill_llama.__file__).parent
WEIGHTS_FILE = "model.safetensors"

FAMILY_FILES = {
    "llama": ("configuration_distill_llama.py", "modeling_distill_llama.py"),
    "bert": ("configuration_distill_bert.py", "modeling_distill_bert.py"),
}
"""The two files each family's export carries."""

NATIVE_CLASSES: dict[str, type[transformers.PreTrainedModel]] = {
    "DistillLlamaForCausalLM": modeling_distill_llama.DistillLlamaForCausalLM,
    "DistillLlamaModel": modeling_distill_llama.DistillLlamaModel,
    "DistillBertModel": modeling_distill_bert.DistillBertModel,
}
"""``config.json``'s architecture -> distill's copy of that class (what ``load_student`` uses)."""

TEACHER_CLASS_PREFIXES = ("transformers.models.", "torch.nn.modules.")
"""Where the teacher classes a student reuses may come from (GPT-NeoX's final norm is torch's LayerNorm)."""

_DROPPED_KEYS = ("model_type", "architectures", "auto_map", "transformers_version", "layer_types",
                 "_name_or_path", "per_layer_config")
"""Teacher config keys that describe the teacher's own class, not the student."""


def native_class(teacher: Teacher) -> type[transformers.PreTrainedModel]:
    """The student's class: a causal LM when the teacher has an LM head, else the bare model."""
    if teacher.family == "bert":
        return modeling_distill_bert.DistillBertModel
    if teacher.model.get_output_embeddings() is not None:
        return modeling_distill_llama.DistillLlamaForCausalLM
    return modeling_distill_llama.DistillLlamaModel


def student_config(teacher: Teacher, layer_specs: dict[int, dict[str, Any]], for_export: bool = True,
                   dtype: torch.dtype | None = None) -> transformers.PreTrainedConfig:
    """The student's config: the teacher's keys, its classes, and ``layer_specs[l]`` per replaced layer.

    ``for_export=False`` (a replacement building its modules around copies of the teacher's)
    leaves out the teacher's classes, which only an export needs and only transformers'
    own teachers have.
    """
    teacher_config = teacher.model.config
    keys = {k: v for k, v in teacher_config.to_dict().items() if k not in _DROPPED_KEYS}
    # GPT-2 names hidden_size n_embd: the student has no attribute map, so it gets both names
    keys.update({k: getattr(teacher_config, k) for k in getattr(teacher_config, "attribute_map", {})})
    keys["dtype"] = str(dtype or teacher.dtype).removeprefix("torch.")
    classes = teacher_classes(teacher) if for_export else {}
    common = {"teacher_model_type": teacher_config.model_type, "teacher_classes": classes,
              "distill_layers": {str(idx): spec for idx, spec in sorted(layer_specs.items())}}
    if teacher.family == "bert":
        config = DistillBertConfig(**common, **keys)
    else:
        layer_types = get_layer_types_and_kwargs(teacher_config)[0]
        config = DistillLlamaConfig(
            **common, teacher_layer_types=layer_types, teacher_norm_eps=_norm_eps(teacher),
            distill_embedding=families.embedding_scale(teacher.adapter, teacher_config),
            distill_logits=families.logits_transform(teacher.adapter, teacher_config),
            teacher_attn_implementation=teacher_config._attn_implementation,
            distill_learned_positions=_learned_positions(teacher), **keys,
        )
    config._attn_implementation = teacher_config._attn_implementation
    return config


def _learned_positions(teacher: Teacher) -> int | None:
    """How many positions the family's learned position embedding holds (GPT-2's ``wpe``), or None."""
    if teacher.adapter.learned_positions is None:
        return None
    return teacher.model.base_model.get_submodule(teacher.adapter.learned_positions).num_embeddings


def _norm_eps(teacher: Teacher) -> float:
    """The epsilon of the teacher's final norm, whatever its config calls it (rms_norm_eps, layer_norm_eps)."""
    norm = teacher.model.base_model.get_submodule(teacher.adapter.final_norm)
    return float(next(getattr(norm, attr) for attr in ("eps", "variance_epsilon") if hasattr(norm, attr)))


def teacher_classes(teacher: Teacher) -> dict[str, str]:
    """Dotted paths of the teacher's classes the student reuses; only transformers' own can be exported."""
    base = teacher.model.base_model
    if teacher.family == "bert":
        parts = {"embeddings": base.embeddings, "layer": teacher.layers[0], "pooler": getattr(base, "pooler", None)}
    else:
        parts = {"layer": teacher.layers[0], "norm": base.get_submodule(teacher.adapter.final_norm),
                 "rotary": base.rotary_emb if teacher.adapter.rotary else None}
    paths = {role: f"{type(m).__module__}.{type(m).__qualname__}" for role, m in parts.items() if m is not None}
    layer_classes = {type(layer) for layer in teacher.layers}
    outside = [path for path in paths.values() if not path.startswith(TEACHER_CLASS_PREFIXES)]
    if outside or len(layer_classes) > 1:
        raise ValueError(
            f"Cannot export a student of {type(teacher.model).__name__}: its classes {outside or layer_classes} "
            "are not one transformers layer class (remote-code or mixed-layer teachers). Use "
            "`from distill import load_student` on a format-1 export, or a transformers teacher."
        )
    return paths


def layers_prefix(teacher: Teacher) -> str:
    """Where the layer list sits in the base model's state dict."""
    return "encoder.layer." if teacher.family == "bert" else "layers."


def native_state(
    teacher: Teacher, replacements: dict[int, nn.Module], include_tied: bool = False,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """The student's weights under the native names, in ``dtype`` (default: the teacher's).

    Teacher parts keep the teacher's names (relative to its base model, with ``model.`` for
    causal LMs); replaced layer l's weights are ``<layers>.l.<its own state-dict names>``,
    the names the modeling code gives that kind. A tied LM head is left out unless asked for
    (``save_file`` refuses shared tensors; ``from_pretrained`` ties it back).
    """
    prefix = layers_prefix(teacher)
    replaced = tuple(f"{teacher.adapter.layers_path}.{idx}." for idx in replacements)
    state = {_student_name(teacher, k): v for k, v in teacher.model.base_model.state_dict().items()
             if not k.startswith(replaced)}
    for idx, module in replacements.items():
        state.update({f"{prefix}{idx}.{k}": v for k, v in module.state_dict().items()})
    if native_class(teacher) is modeling_distill_llama.DistillLlamaForCausalLM:
        state = {f"model.{k}": v for k, v in state.items()}
        head = teacher.model.get_output_embeddings().weight
        if include_tied or head is not teacher.model.get_input_embeddings().weight:
            state["lm_head.weight"] = head
    return {k: _in_dtype(v, dtype or teacher.dtype) for k, v in state.items()}


def _student_name(teacher: Teacher, name: str) -> str:
    """A base-model weight's name in the student: the family's layer list, embeddings and final norm
    under the student's own names (``layers``, ``embed_tokens``, ``embed_positions``, ``norm``),
    everything else as the teacher names it."""
    adapter = teacher.adapter
    if adapter.modeling != "llama":
        return name
    for own, student in ((adapter.layers_path, "layers"), (adapter.embed_name, "embed_tokens"),
                         (adapter.final_norm, "norm"), (adapter.learned_positions, "embed_positions")):
        if own is None:
            continue
        if name.startswith(f"{own}."):
            return f"{student}.{name.removeprefix(own + '.')}"
    return name


def _in_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach()
    return out.contiguous()


def write_native(out_dir: str, teacher: Teacher, replacements: dict[int, nn.Module],
                 layer_specs: dict[int, dict[str, Any]], dtype: torch.dtype | None = None
                 ) -> transformers.PreTrainedConfig:
    """Write config.json (with ``auto_map``), the modeling files, model.safetensors in ``dtype``
    (default: the teacher's; float32-trained replacements are cast) and generation_config.json
    (causal LMs) to ``out_dir``; returns the config."""
    os.makedirs(out_dir, exist_ok=True)
    config = student_config(teacher, layer_specs, dtype=dtype)
    model_cls = native_class(teacher)
    config_file, modeling_file = FAMILY_FILES[teacher.family]
    config.architectures = [model_cls.__name__]
    config.auto_map = _auto_map(config_file, modeling_file, type(config).__name__, model_cls)
    config.use_cache = teacher.family != "bert"
    for name in FAMILY_FILES[teacher.family]:
        shutil.copyfile(MODELING_DIR / name, os.path.join(out_dir, name))
    _write_config(config, out_dir)
    safetensors.torch.save_file(native_state(teacher, replacements, dtype=dtype), os.path.join(out_dir, WEIGHTS_FILE),
                                metadata={"format": "pt"})
    generation = getattr(teacher.model, "generation_config", None)
    if model_cls is modeling_distill_llama.DistillLlamaForCausalLM and generation is not None:
        generation = transformers.GenerationConfig.from_dict(generation.to_dict())
        generation.use_cache = True
        generation.save_pretrained(out_dir)
    return config


def _auto_map(config_file: str, modeling_file: str, config_name: str, model_cls: type) -> dict[str, str]:
    """Which class each Auto class loads: the bare model for AutoModel, the LM for AutoModelForCausalLM."""
    modeling = modeling_file.removesuffix(".py")
    auto_map = {"AutoConfig": f"{config_file.removesuffix('.py')}.{config_name}"}
    if model_cls is modeling_distill_llama.DistillLlamaForCausalLM:
        auto_map["AutoModel"] = f"{modeling}.DistillLlamaModel"
        auto_map["AutoModelForCausalLM"] = f"{modeling}.DistillLlamaForCausalLM"
    else:
        auto_map["AutoModel"] = f"{modeling}.{model_cls.__name__}"
    return auto_map


def _write_config(config: transformers.PreTrainedConfig, out_dir: str) -> None:
    """config.json exactly as built (``save_pretrained`` would rewrite the auto_map for the config alone)."""
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        f.write(config.to_json_string(use_diff=False))


def load_native(path: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
                ) -> transformers.PreTrainedModel:
    """The student in ``path`` with distill's copy of its classes, every weight present and used."""
    with open(os.path.join(path, "config.json")) as f:
        architectures = json.load(f).get("architectures") or []
    model_cls = next((NATIVE_CLASSES[a] for a in architectures if a in NATIVE_CLASSES), None)
    if model_cls is None:
        raise ValueError(f"{path}/config.json names {architectures}, no distill student class "
                         f"({sorted(NATIVE_CLASSES)}); re-export the student.")
    try:
        model, info = model_cls.from_pretrained(path, dtype=dtype, output_loading_info=True)
    except RuntimeError as err:  # tensors of other shapes
        raise _mismatch(path, str(err).splitlines()[0]) from err
    bad = {k: sorted(v)[:8] for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise _mismatch(path, str(bad))
    return model.to(device).eval().requires_grad_(False)


def _mismatch(path: str, detail: str) -> ValueError:
    return ValueError(f"{path}/{WEIGHTS_FILE} does not match its config.json ({detail}); the config was edited "
                      "or the files come from different exports: re-export the student.")


def build_native(teacher: Teacher, replacements: dict[int, nn.Module], layer_specs: dict[int, dict[str, Any]],
                 dtype: torch.dtype | None = None) -> transformers.PreTrainedModel:
    """The native student in memory, through the same files and loader as an export."""
    with tempfile.TemporaryDirectory(prefix="distill-native-") as tmp:
        write_native(tmp, teacher, replacements, layer_specs)
        return load_native(tmp, dtype=dtype, device=teacher.device)
