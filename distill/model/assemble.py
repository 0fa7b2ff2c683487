"""Students assembled from a teacher and its trained replacements: in memory, on disk, loaded back.

`splice` puts replacements into a copy of the teacher model (the end-to-end stage trains
that). `export_student` writes the student as an HF-native model directory, loadable where
distill is not installed:

    out_dir/
        config.json                 model_type distill_llama / distill_bert, auto_map, the
                                    teacher's keys, distill_layers (see distill.model.modeling)
        configuration_distill_*.py  the student's own config and modeling code (copied from
        modeling_distill_*.py       distill.model.modeling; torch + transformers only)
        model.safetensors           every weight, under the modeling code's names
        generation_config.json      decoders (use_cache=True)
        tokenizer files             when a tokenizer is given
        distill_student.json        {"format": 2, "family", "teacher_source",
                                     "layers": {"<l>": replacement Hydra cfg}}
        README.md                   the model card (written by distill.results.card)

    AutoModelForCausalLM.from_pretrained(out_dir, trust_remote_code=True)  # AutoModel: encoders

`load_student` loads it with distill's copy of the same classes (the same logits), and still
reads format 1 (the spliced teacher model of earlier versions, `use_cache=False`), which it
rebuilds into the native model.

`splice`'s spliced layers assume unpadded sequences at positions 0..T-1 and keep no cache
(`use_cache=False`); the native student takes padding masks, position ids and a cache.

Shape legend: B batch, T sequence length, D hidden size.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from typing import Any

import hydra.utils
import safetensors.torch
import torch
import transformers
from torch import nn

from distill.config import plain
from distill.model.native import WEIGHTS_FILE, build_native, load_native, write_native
from distill.model.teacher import TORCH_DTYPES, Teacher, call_in_own_dtype, model_class, parse_dtype

try:  # how transformers 5.x collects output_hidden_states; see _record_hidden_states
    from transformers.utils.output_capturing import (
        _active_collector,
        install_output_capuring_hook,
    )
except ImportError:  # pragma: no cover - other transformers versions
    _active_collector = install_output_capuring_hook = None

log = logging.getLogger(__name__)

STUDENT_FORMAT = 2
"""Version of `distill_student.json`; bump when the directory layout changes (2: HF-native)."""

LEGACY_FORMAT = 1
"""The spliced-teacher layout of earlier versions, still read by `load_student`."""

STUDENT_FILE = "distill_student.json"


class SplicedLayer(nn.Module):
    """A replacement sitting where an HF decoder/encoder layer was.

    Accepts whatever the model's layer loop passes (`hidden_states` first, then masks,
    `position_embeddings`, `cache`, ...) and ignores all but `hidden_states`, because a
    replacement builds its own causal mask and rotary embeddings. In transformers 5.x
    both `LlamaModel` and `BertEncoder` take a plain tensor back from each layer, so
    that is what this returns, in the dtype it got (a float32 replacement in a bfloat16
    teacher computes in float32: `call_in_own_dtype`).
    """

    def __init__(self, replacement: nn.Module) -> None:
        super().__init__()
        self.replacement = replacement
        self.layer_idx = getattr(replacement, "layer_idx", None)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """replacement(hidden_states) in its own dtype; refuses a KV cache, which it could not keep up."""
        if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
            raise ValueError(
                f"A KV cache reached spliced layer {self.layer_idx}, but replacements keep none "
                "and would see only the new tokens. Call the student with `use_cache=False` "
                "(its config already defaults to it)."
            )
        if _active_collector is None:
            return call_in_own_dtype(self.replacement, hidden_states)
        token = _active_collector.set(None)  # inner HF layers must not record outputs
        try:
            return call_in_own_dtype(self.replacement, hidden_states)
        finally:
            _active_collector.reset(token)


# ---------------------------------------------------------------------- splice


def splice(teacher: Teacher, replacements: dict[int, nn.Module],
           share_weights: bool = False) -> transformers.PreTrainedModel:
    """A copy of `teacher.model` with layer l replaced by `replacements[l]`.

    The teacher model is left untouched (it keeps producing targets); the replacement
    modules themselves are not copied, so the result shares their weights and sees
    further training. The copy gets `use_cache=False` in its config and generation
    config because replacements keep no KV cache (see the module docstring).
    Replacements that call `teacher.run_layer` (TeacherCopy, PrunedLayer, LowRankLayer)
    take rotary embeddings and masks from the teacher, so keep the result on the
    teacher's device; `load_student` builds a self-contained model instead.

    `share_weights=True` copies only the module tree: every parameter and buffer is
    the teacher's own tensor, so a frozen base costs no second copy of the embeddings,
    head and kept layers (for a 1B Llama with a 32k vocabulary, 0.5 GB in float32).
    Training such a result must leave the teacher's parameters frozen.
    """
    teacher.check_layer_idxs(list(replacements))
    # Map the teacher layers about to be replaced to themselves: they are never copied.
    memo = {id(teacher.layers[idx]): teacher.layers[idx] for idx in replacements}
    if share_weights:
        memo.update({id(t): t for t in (*teacher.model.parameters(), *teacher.model.buffers())})
    model = copy.deepcopy(teacher.model, memo)
    _splice_in_place(model, layer_list_name(teacher), replacements)
    return model


def _splice_in_place(
    model: transformers.PreTrainedModel, layers_name: str, replacements: dict[int, nn.Module]
) -> None:
    """Put a SplicedLayer at each replaced index of `model`'s layer list; turn the cache off."""
    layers = model.get_submodule(layers_name)
    for idx, replacement in sorted(replacements.items()):
        spliced = SplicedLayer(replacement)
        _record_hidden_states(spliced)
        layers[idx] = spliced
    model.config.use_cache = False
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = False


def layer_list_name(teacher: Teacher) -> str:
    """Dotted name of the teacher's layer ModuleList inside `teacher.model`.

    Found by identity, so the family's layout stays decided in `distill.model.teacher` alone.
    """
    for name, module in teacher.model.named_modules():
        if module is teacher.layers:
            return name
    raise AssertionError("teacher.layers is not a submodule of teacher.model")


def _record_hidden_states(spliced: SplicedLayer) -> None:
    """Make `output_hidden_states=True` count the spliced layer like the layer it replaced.

    transformers collects hidden states with hooks on modules of the layer class
    (`_can_record_outputs`), which a SplicedLayer is not; without this its output would
    be silently missing and every later index shifted. The hook is inert unless hidden
    states are requested.
    """
    if install_output_capuring_hook is None:
        log.warning("this transformers cannot record spliced layers in output_hidden_states")
        return
    install_output_capuring_hook(spliced, "hidden_states", index=0)


# ---------------------------------------------------------------------- export


def export_student(
    teacher: Teacher,
    teacher_source: str,
    replacements: dict[int, nn.Module],
    replacement_cfgs: dict[int, dict],
    out_dir: str,
    tokenizer: Any = None,
    dtype: torch.dtype | None = None,
) -> str:
    """Write the HF-native student to `out_dir` (layout in the module docstring); returns it.

    `replacement_cfgs[l]` is the Hydra config that built `replacements[l]` (with
    `_target_` and `_partial_`), kept in distill_student.json as the record of what was
    trained; the model itself is rebuilt from config.json alone. The weights are saved in
    `dtype` (default: the teacher's), the dtype config.json then declares.
    """
    _check_cfgs(replacements, replacement_cfgs)
    specs = {idx: module.layer_spec() for idx, module in replacements.items()}
    write_native(out_dir, teacher, replacements, specs, dtype=dtype)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    manifest = {
        "format": STUDENT_FORMAT,
        "family": teacher.family,
        "teacher_source": teacher_source,
        "layers": {str(idx): _plain_cfg(cfg) for idx, cfg in sorted(replacement_cfgs.items())},
    }
    with open(os.path.join(out_dir, STUDENT_FILE), "w") as f:
        json.dump(manifest, f, indent=2)
    log.info("student with %d replaced layers written to %s", len(replacements), out_dir)
    return out_dir


def _check_cfgs(replacements: dict[int, nn.Module], replacement_cfgs: dict[int, Any]) -> None:
    """Every replacement needs the config that rebuilds it, and nothing else."""
    if set(replacements) != set(replacement_cfgs):
        raise ValueError(
            f"export_student got replacements for layers {sorted(replacements)} but configs for "
            f"{sorted(replacement_cfgs)}; pass one `replacement_cfgs[l]` per replaced layer."
        )
    for idx, cfg in replacement_cfgs.items():
        if "_target_" not in cfg:
            raise ValueError(
                f"replacement_cfgs[{idx}] has no `_target_`; pass the Hydra `replacement` config "
                "that built the module (e.g. from conf/replacement/*.yaml)."
            )


def _plain_cfg(cfg: dict) -> dict:
    """A JSON-ready copy of a replacement config (the manifest must not share it with the caller)."""
    return plain(copy.deepcopy(dict(cfg)), enums_as_str=True)


# ---------------------------------------------------------------------- load


def load_student(
    path: str, device: str = "cpu", dtype: str | None = None
) -> transformers.PreTrainedModel:
    """Load a student written by `export_student`, ready for `forward()` and `generate()`.

        from distill import load_student
        model = load_student("outputs/.../student")

    The HF-native model of the directory (what `AutoModelForCausalLM.from_pretrained(path,
    trust_remote_code=True)` gives, through distill's copy of its modeling code), every
    weight checked present and used. `dtype` ("float32", "bfloat16", "float16") defaults to
    the saved one. A format-1 directory (distill before the native export) is rebuilt into
    the same native model. The model comes back in eval mode with gradients off.
    """
    manifest = _read_manifest(path)
    torch_dtype = _student_dtype(dtype, None) if dtype is not None else None
    if manifest["format"] == LEGACY_FORMAT:
        model = _load_legacy(path, manifest, device, dtype)
    else:
        model = load_native(path, dtype=torch_dtype, device=device)
    log.info("loaded student from %s: layers %s replaced", path, sorted(int(k) for k in manifest["layers"]))
    return model


def _load_legacy(path: str, manifest: dict, device: str, dtype: str | None) -> transformers.PreTrainedModel:
    """A format-1 directory: the spliced teacher model rebuilt and checked as before, then made native."""
    log.info("%s is a format-1 student (no cache, no padding masks); loading it as the native model. "
             "Re-export it (save_pretrained of the loaded model) to keep it that way.", path)
    model = _build_from_config(path, manifest["family"], dtype)
    state = safetensors.torch.load_file(os.path.join(path, WEIGHTS_FILE))  # mmap on CPU
    # Teacher parts first, so replacements initialise from the real embeddings and rotary.
    own_keys = set(model.state_dict())
    model.load_state_dict({k: v for k, v in state.items() if k in own_keys}, strict=False)
    teacher = Teacher(model, device=device)
    replacements = _build_replacements(teacher, manifest["layers"])
    layers_name = layer_list_name(teacher)
    originals = {idx: teacher.layers[idx] for idx in replacements}
    _splice_in_place(model, layers_name, replacements)
    _load_strict(model, state, path)
    layers = model.get_submodule(layers_name)
    for idx, layer in originals.items():  # the teacher's layers back: the native build reads them
        layers[idx] = layer
    specs = {idx: module.layer_spec() for idx, module in replacements.items()}
    return build_native(teacher, replacements, specs, dtype=teacher.dtype)


def _build_replacements(teacher: Teacher, layer_cfgs: dict[str, dict]) -> dict[int, nn.Module]:
    """Each saved replacement config, instantiated for its layer as the trainer did.

    Built while `teacher.layers` still holds the original layers, which some replacements
    read at construction (PrunedLayer's layout, copies of the layer's modules).
    """
    replacements = {}
    for idx, cfg in layer_cfgs.items():
        build = hydra.utils.instantiate({**cfg, "_partial_": True})
        replacements[int(idx)] = build(teacher=teacher, layer_idx=int(idx))
    return replacements


def _read_manifest(path: str) -> dict:
    """distill_student.json of `path`, checked for a format this code can read."""
    manifest_path = os.path.join(path, STUDENT_FILE)
    if not os.path.isfile(manifest_path):
        raise ValueError(
            f"{path!r} has no {STUDENT_FILE}: it is not a student directory. Pass the directory "
            "written by distill.model.assemble.export_student (a run's `student/`)."
        )
    with open(manifest_path) as f:
        manifest = json.load(f)
    if manifest.get("format") not in (LEGACY_FORMAT, STUDENT_FORMAT):
        raise ValueError(
            f"{manifest_path} has format {manifest.get('format')!r}; this distill reads formats "
            f"{LEGACY_FORMAT} and {STUDENT_FORMAT}. Re-export the student or use the distill version "
            "that wrote it."
        )
    return manifest


def _build_from_config(path: str, family: str, dtype: str | None) -> transformers.PreTrainedModel:
    """The teacher's architecture with fresh weights, in the requested or saved dtype."""
    config = transformers.AutoConfig.from_pretrained(path)
    torch_dtype = _student_dtype(dtype, config)
    model_cls = model_class(config, family)
    if issubclass(model_cls, transformers.PreTrainedModel):
        model = model_cls._from_config(config, dtype=torch_dtype)
    else:  # an Auto class
        model = model_cls.from_config(config, dtype=torch_dtype)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    return model


def _student_dtype(dtype: str | None, config: transformers.PretrainedConfig | None) -> torch.dtype:
    """`dtype` by name, else the dtype recorded in config.json at export (float32 if none)."""
    if dtype is not None:
        if dtype not in TORCH_DTYPES:
            raise ValueError(
                f"load_student(dtype={dtype!r}) is not supported; choose one of {[d.value for d in TORCH_DTYPES]} "
                "or None for the dtype the student was saved in."
            )
        return parse_dtype(dtype)
    saved = getattr(config, "dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    return saved if isinstance(saved, torch.dtype) else torch.float32


def _load_strict(model: nn.Module, state: dict[str, torch.Tensor], path: str) -> None:
    """`load_state_dict(strict=True)`, except that a name tied to a saved one may be absent.

    `safetensors.torch.save_model` keeps one name per shared tensor (e.g. embed_tokens
    for a tied lm_head); the other names alias the same Parameter, so they load with it.
    """
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a tensor of another shape
        raise _mismatch(path, str(err)) from err
    aliased = _names_sharing_a_tensor_with(model, set(state))
    missing = [name for name in missing if name not in aliased]
    if missing or unexpected:
        raise _mismatch(path, f"missing {missing[:8]}, unexpected {list(unexpected)[:8]}")


def _mismatch(path: str, detail: str) -> ValueError:
    return ValueError(
        f"{os.path.join(path, WEIGHTS_FILE)} does not match the model rebuilt from "
        f"{STUDENT_FILE}: {detail}. The replacement code or its options changed since export; "
        "load it with the distill version that wrote it, or re-export."
    )


def _names_sharing_a_tensor_with(model: nn.Module, names: set[str]) -> set[str]:
    """State-dict names whose tensor is the very object of one of `names`."""
    tensors = model.state_dict(keep_vars=True)
    present = {id(tensors[name]) for name in names if name in tensors}
    return {name for name, tensor in tensors.items() if id(tensor) in present}
