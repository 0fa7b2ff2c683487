"""The frozen HuggingFace teacher, run one layer at a time.

Layer-by-layer distillation needs three things from the teacher: the hidden states
entering and leaving chosen layers (`capture`), a way to call a layer, or a trainable
copy of it, exactly as the full model would (`run_layer`), and the parts around the
layer stack (`embed`, `final_hidden`, `final_logits`). Everything assumes fixed-length,
unpadded chunks (see `distill.model.data`), so positions are always 0..T-1 and the only
mask is the causal one.

The family (`distill.model.family`, by `config.model_type`) says where the layers are and
what happens after them (final norm, logit scaling and soft-caps). What a layer receives is
not rebuilt by hand: the model's own forward is run once per sequence length with hooks
that record what it passes each layer (masks of each layer's attention type, rotary
embeddings, positions) and what enters layer 0 (embeddings with any family scaling), so
`embed` + `run_layer` + `final_logits` equal the model's forward for every supported family
(held by tests/unit/model/test_family.py).

Shape legend:
    B: batch size
    T: sequence length (tokens per chunk)
    D: hidden size
    V: vocabulary size
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
import transformers
from torch import nn

from distill.config import Dtype
from distill.model import family as families
from distill.model.location import check_exists

log = logging.getLogger(__name__)

FAMILIES = ("llama", "bert")
"""The exported student's modeling families (`Family.modeling`); `distill.model.family.FAMILIES` lists the HF ones."""

TORCH_DTYPES: dict[Dtype, torch.dtype] = {
    Dtype.float32: torch.float32, Dtype.bfloat16: torch.bfloat16, Dtype.float16: torch.float16,
}
"""The torch dtype of each `teacher.dtype` (the one table; `load_student` uses it too)."""

CAUSAL_LM_FAMILIES = ("llama",)
"""Families rebuilt with AutoModelForCausalLM when a config names no known class."""


class _StopForward(Exception):
    """Raised by the hook on the last captured layer so that later layers never run."""


_PROBE_DROPPED = ("hidden_states", "past_key_values", "cache", "layer_past", "use_cache", "output_attentions")
"""Layer keyword arguments a probe does not keep: the hidden state itself and cache switches."""


class Teacher:
    """A frozen HF model plus what is needed to run its layers one at a time."""

    def __init__(self, model: transformers.PreTrainedModel, device: str | torch.device | None = "cpu"):
        """Detect the family, move the model to `device` and freeze it (eval, no grads).

        `device=None` leaves the model where it is: placed by a transformers `device_map`,
        its layers possibly on several GPUs. `device` is then where its inputs go (the
        embeddings' device) and `devices` lists every device that holds a part of it.
        """
        if device is not None:
            model = model.to(torch.device(device))
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.devices = sorted({p.device for p in model.parameters()}, key=str)
        self.device = model.get_input_embeddings().weight.device
        self._base = model.base_model
        config = model.config
        self.adapter = families.detect(config)
        self.family = self.adapter.modeling
        if self.family == "llama":
            _check_decoder_attention(self.layers)
        self.causal = _is_causal(self.family, config)
        self._probed: dict[tuple[int, str], list[dict[str, Any]]] = {}
        self._probe_lock = threading.Lock()
        self.num_layers = len(self.layers)
        self.hidden_size = int(config.hidden_size)
        self.dtype = next(model.parameters()).dtype
        self.name_or_path = getattr(config, "_name_or_path", "") or type(model).__name__
        log.info(
            "teacher %s: family=%s (%s) layers=%d hidden=%d dtype=%s device=%s attn=%s",
            self.name_or_path, self.adapter.name, self.family, self.num_layers, self.hidden_size, self.dtype,
            ",".join(map(str, self.devices)), getattr(config, "_attn_implementation", None),
        )

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        dtype: str = "float32",
        device: str = "cpu",
        attn_implementation: str | None = None,
        device_map: str | dict | None = None,
        max_memory: dict | None = None,
    ) -> Teacher:
        """Load a local checkpoint directory or a hub name (hub names need network).

        The class named in the checkpoint's `architectures` is used, so a saved
        `LlamaForCausalLM` keeps its lm_head; without it the bare model is loaded.
        With `device_map` (and `max_memory`, see `teacher_device_map`) transformers places
        the model itself, layer by layer, over several devices (a teacher larger than
        one GPU), with accelerate's hooks moving hidden states between them; `device` is
        then not used.
        """
        torch_dtype = parse_dtype(dtype)
        path = check_exists(name_or_path)
        model_cls = model_class(_load_config(path))
        kwargs = {"dtype": torch_dtype}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        if device_map is not None:
            kwargs.update(device_map=device_map, max_memory=max_memory)
        model = model_cls.from_pretrained(path, **kwargs)
        return cls(model, device=None if device_map is not None else device)

    # ------------------------------------------------------------------ the stack

    @property
    def layers(self) -> nn.ModuleList:
        """The teacher's own layer modules, in order."""
        return self._base.get_submodule(self.adapter.layers_path)

    def embed(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Exactly what layer 0 receives (hidden_BTD): the model's own embeddings, scaling included."""
        return self._inputs_of_layer0(input_ids_BT.to(self.device))

    def run_layer(self, layer: nn.Module, hidden_BTD: torch.Tensor, layer_idx: int | None = None) -> torch.Tensor:
        """Call one HF layer (the teacher's own or a structurally compatible copy) with
        the arguments the full model passes layer `layer_idx` (found from `layer` when not
        given) for an unpadded chunk at positions 0..T-1.

        Gradients flow through it, so students can train copies of layers here.
        """
        output = layer(hidden_BTD, **self.layer_kwargs(hidden_BTD, layer, layer_idx))
        return output[0] if isinstance(output, tuple) else output

    def layer_kwargs(self, hidden_BTD: torch.Tensor, layer: nn.Module | None = None,
                     layer_idx: int | None = None) -> dict:
        """Keyword arguments the model's own forward gives layer `layer_idx` for an unpadded chunk.

        Recorded from one forward of the model per (sequence length, device): masks of the
        layer's attention type (None for sdpa on an unpadded causal chunk, which relies on
        `is_causal`), rotary `position_embeddings`, `position_ids`. They were recorded for a
        batch of one and broadcast over any batch.
        """
        idx = self._layer_index(layer, layer_idx)
        return dict(self._probe(hidden_BTD.shape[1], hidden_BTD.device)[idx])

    def _layer_index(self, layer: nn.Module | None, layer_idx: int | None) -> int:
        """`layer_idx`, else `layer`'s position in the stack, else the index its attention records."""
        if layer_idx is not None:
            return layer_idx
        for idx, own in enumerate(self.layers):
            if own is layer:
                return idx
        for owner in (layer, getattr(layer, "self_attn", None), getattr(layer, "attention", None)):
            value = getattr(owner, "layer_idx", None)
            if isinstance(value, int):
                return value
        return 0

    def _inputs_of_layer0(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """Run the model's forward up to layer 0 and return what layer 0 was given."""
        seen: dict[str, torch.Tensor] = {}
        thread_id = threading.get_ident()

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if threading.get_ident() == thread_id:
                seen["hidden"] = args[0] if args else kwargs["hidden_states"]
                raise _StopForward

        handle = self.layers[0].register_forward_pre_hook(pre_hook, with_kwargs=True)
        try:
            self._base(input_ids=input_ids_BT, use_cache=False)
        except _StopForward:
            pass
        finally:
            handle.remove()
        return seen["hidden"]

    def _probe(self, seq_len: int, device: torch.device) -> list[dict[str, Any]]:
        """The kwargs of each layer in one forward of a batch of zeros at length `seq_len`."""
        key = (seq_len, str(device))
        with self._probe_lock:
            if key not in self._probed:
                self._probed[key] = self._record_layer_kwargs(seq_len)
            return self._probed[key]

    @torch.no_grad()
    def _record_layer_kwargs(self, seq_len: int) -> list[dict[str, Any]]:
        recorded: dict[int, dict[str, Any]] = {}
        thread_id = threading.get_ident()

        def recorder(idx: int):
            def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
                if threading.get_ident() == thread_id:
                    recorded[idx] = {k: v for k, v in kwargs.items() if k not in _PROBE_DROPPED}
            return pre_hook

        handles = [layer.register_forward_pre_hook(recorder(idx), with_kwargs=True)
                   for idx, layer in enumerate(self.layers)]
        input_ids_1T = torch.zeros(1, seq_len, dtype=torch.long, device=self.device)
        try:
            self._base(input_ids=input_ids_1T, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        assert len(recorded) == self.num_layers, "a layer did not run in the probe forward"
        return [recorded[idx] for idx in range(self.num_layers)]

    @torch.no_grad()
    def capture(
        self, input_ids_BT: torch.Tensor, layer_idxs: list[int]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{l: (input_BTD, output_BTD)} of each layer in `layer_idxs`, for one batch.

        Runs the model's own forward with hooks on the layer modules and stops it right
        after layer max(layer_idxs), so the cost is that of max(layer_idxs)+1 layers.
        The tensors are detached and stay on the device of the layer that made them (the
        teacher's device, or its layer's GPU under a device map), in the teacher's dtype.
        Threads may capture on one teacher at once: each call's hooks act on its own
        thread's forward only.
        """
        if not layer_idxs:
            return {}
        self.check_layer_idxs(layer_idxs)
        last_idx = max(layer_idxs)
        captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        thread_id = threading.get_ident()
        handles = [
            self.layers[idx].register_forward_hook(
                _capture_hook(idx, captured, stop=idx == last_idx, thread_id=thread_id), with_kwargs=True
            )
            for idx in sorted(set(layer_idxs))
        ]
        try:
            self._base(input_ids=input_ids_BT.to(self.device), use_cache=False)
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        assert set(captured) == set(layer_idxs), "a captured layer did not run"
        return captured

    def check_layer_idxs(self, layer_idxs: list[int]) -> None:
        """Reject layer indices outside 0..num_layers-1 (negative ones are ambiguous here)."""
        bad = [idx for idx in layer_idxs if not 0 <= idx < self.num_layers]
        if bad:
            raise ValueError(
                f"Layer indices {bad} are out of range: the teacher has layers 0..{self.num_layers - 1}."
            )

    # ------------------------------------------------------------------ after the stack

    def final_hidden(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """The model's last_hidden_state given the last layer's output: the family's final
        norm, or the identity where layers end in their own norm (BERT)."""
        if self.adapter.final_norm is None:
            return hidden_BTD
        return self._base.get_submodule(self.adapter.final_norm)(hidden_BTD)

    def final_logits(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        """Next-token logits_BTV from the last layer's output: final norm, lm_head, then the
        family's logit scaling and soft-cap, as the model's forward does."""
        if self.family != "llama":
            raise ValueError(
                f"final_logits needs a causal LM teacher; `teacher.name_or_path={self.name_or_path}` "
                f"is a {self.family} encoder. Use final_hidden instead."
            )
        lm_head = self.model.get_output_embeddings()
        if lm_head is None:
            raise ValueError(
                f"`teacher.name_or_path={self.name_or_path}` loaded without an lm_head "
                f"({type(self.model).__name__}). Save it as a *ForCausalLM checkpoint."
            )
        logits_BTV = lm_head(self.final_hidden(hidden_BTD))
        transform = families.logits_transform(self.adapter, self.model.config)
        if transform["divisor"] is not None:
            logits_BTV = logits_BTV / transform["divisor"]
        if transform["softcap"] is not None:
            logits_BTV = torch.tanh(logits_BTV / transform["softcap"]) * transform["softcap"]
        return logits_BTV

    # ------------------------------------------------------------------ cost

    def layer_flops_per_token(self, seq_len: int) -> int:
        """Approximate forward FLOPs per token of one teacher layer at context `seq_len`.

        2 FLOPs per weight of every matmul (nn.Linear) in the layer, plus attention
        scores and weighted sum, 2 * 2 * seq_len * (heads * head_dim), counted over the
        full T x T (no causal halving, the convention of Kaplan et al. 2020). Replacements
        should count their own cost the same way so that the ratio is meaningful.
        """
        layer = self.layers[0]
        matmul_weights = sum(m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear))
        return 2 * matmul_weights + 4 * seq_len * self._attention_width()

    def _attention_width(self) -> int:
        """heads * head_dim: the width of queries and keys that scale with context."""
        config = self.model.config
        num_heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or self.hidden_size // num_heads
        return num_heads * int(head_dim)


# ---------------------------------------------------------------------- placement


def teacher_device_map(devices: list[int | str], max_memory: dict | None = None) -> dict:
    """`from_pretrained` arguments that spread one teacher over `devices` (GPU indices, or
    "cpu"): transformers' own ``device_map="balanced"`` planner (accelerate's), given only
    those devices, so layers are split evenly over the GPUs, embeddings on the first and
    the head on the last. Each device's budget is its free memory now unless
    `max_memory` says otherwise.
    """
    if not devices:
        raise ValueError("device.worker_gpus is empty: list the GPUs the teacher spreads over, or null")
    budget = {device: _free_bytes(device) for device in devices}
    return {"device_map": "balanced", "max_memory": {**budget, **(max_memory or {})}}


def _free_bytes(device: int | str) -> int:
    """Free memory of a CUDA device, or the memory available to this machine's CPU."""
    if device == "cpu":
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    if not isinstance(device, int) or not 0 <= device < torch.cuda.device_count():
        raise ValueError(f"device.worker_gpus has {device!r}, but this machine has "
                         f"{torch.cuda.device_count()} CUDA device(s): list indices among them")
    return torch.cuda.mem_get_info(device)[0]


# ---------------------------------------------------------------------- replacements in the stream


def call_in_own_dtype(module: nn.Module, hidden_BTD: torch.Tensor) -> torch.Tensor:
    """``module(hidden_BTD)`` across a dtype boundary: in the module's dtype, out in the stream's.

    Real teachers run in bfloat16 or float16 while replacements train (and are kept) in
    float32, so wherever a replacement sits in the teacher's hidden stream (a spliced
    student, evaluation, the end-to-end stage) its input is cast to its own parameters'
    dtype and its output back to the stream's, as every layer of the teacher hands back
    the dtype it got. A module without floating parameters gets the stream's dtype.
    """
    dtype = _param_dtype(module)
    output_BTD = module(hidden_BTD if dtype is None else hidden_BTD.to(dtype))
    return output_BTD.to(hidden_BTD.dtype)


def _param_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype of the module's first floating-point parameter (None if it has none)."""
    for param in module.parameters():
        if param.is_floating_point():
            return param.dtype
    return None


# ---------------------------------------------------------------------- helpers


def _capture_hook(idx: int, captured: dict, stop: bool, thread_id: int):
    """A forward hook (with kwargs) storing (input, output) of layer `idx` in the forward of
    thread `thread_id` (another thread's forward through the same layer is not ours)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        if threading.get_ident() != thread_id:
            return
        input_BTD = args[0] if args else kwargs["hidden_states"]
        output_BTD = output[0] if isinstance(output, tuple) else output
        captured[idx] = (input_BTD.detach(), output_BTD.detach())
        if stop:
            raise _StopForward

    return hook


def _check_decoder_attention(layers: nn.ModuleList) -> None:
    """Causality relies on `is_causal` when sdpa gets no mask; make sure it is set."""
    for layer in layers:
        attention = getattr(layer, "self_attn", None)
        if attention is not None and getattr(attention, "is_causal", True) is not True:
            raise ValueError(
                f"{type(attention).__name__}.is_causal is not True: this decoder would not be "
                "causal on unmasked chunks. Choose another `teacher.name_or_path`."
            )


def _is_causal(family: str, config: transformers.PretrainedConfig) -> bool:
    """Decoders are causal unless the config says otherwise; BERT only as a decoder."""
    if family == "llama":
        return bool(getattr(config, "is_causal", True))
    return bool(getattr(config, "is_decoder", False))


def parse_dtype(dtype: str) -> torch.dtype:
    """torch dtype from its name in the config (``teacher.dtype``, ``load_student(dtype=)``)."""
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"`teacher.dtype={dtype!r}` is not supported. "
                         f"Choose one of {[d.value for d in TORCH_DTYPES]}.")
    return TORCH_DTYPES[dtype]


def _load_config(path: str) -> transformers.PretrainedConfig:
    """The checkpoint's config, or a ValueError that says what to pass instead."""
    try:
        return transformers.AutoConfig.from_pretrained(path)
    except OSError as err:
        raise ValueError(
            f"Cannot load `teacher.name_or_path={path!r}` ({err}). Give a local checkpoint "
            "directory, or a hub name with network access."
        ) from err


def model_class(config: transformers.PretrainedConfig, family: str | None = None) -> type:
    """The class a checkpoint's config names in `architectures` (so a saved `LlamaForCausalLM`
    keeps its lm_head and a bare model stays bare); else AutoModelForCausalLM for a causal-LM
    `family`, else the bare AutoModel. The one architecture -> class lookup of distill."""
    for name in getattr(config, "architectures", None) or []:
        model_cls = getattr(transformers, name, None)
        if model_cls is not None:
            return model_cls
    if family in CAUSAL_LM_FAMILIES:
        return transformers.AutoModelForCausalLM
    log.warning("the config names no known architecture; loading the bare AutoModel")
    return transformers.AutoModel
