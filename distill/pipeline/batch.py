"""TensorSpec and BatchConfig: how a sample's tensors are laid out in bytes.

The pipeline moves bytes; a :class:`BatchConfig` is the application's statement of
what those bytes are. Tensors are packed back to back in spec order, with no
padding, so that ``nbytes()`` is the plain sum of the tensors' sizes (the seed
README's contract: ``(512, 768) bfloat16 + (512,) int64 -> 790528``).

``decode`` returns views into the buffer it is given (no copy); ``encode`` makes
``bytes`` (inside a worker's ``generator_fn``, large samples go straight into the slot
being filled instead: ``encode_sink.py``); ``write`` copies tensors straight into a
writable buffer, and ``copy_into`` into views ``decode`` made once (the paths workers
use to fill shared-memory slots).
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from distill.pipeline import encode_sink

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a sample: its shape and dtype name (see ``DTYPES``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(
                f"TensorSpec {self.name!r}: unsupported dtype {self.dtype!r}; "
                f"use one of {sorted(DTYPES)}"
            )
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"TensorSpec {self.name!r}: negative dimension in shape {shape}")
        object.__setattr__(self, "shape", shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


class BatchConfig:
    """An ordered list of :class:`TensorSpec`: encode, decode and write samples."""

    def __init__(self, specs: Iterable[TensorSpec | Mapping[str, Any]]) -> None:
        self.specs: list[TensorSpec] = [_as_spec(s) for s in specs]
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"BatchConfig: duplicate tensor names in {names}")
        self._offsets: dict[str, int] = {}
        self._layout: list[tuple[str, int, int, torch.dtype]] = []
        """(name, offset, bytes, dtype) of each non-empty tensor: what ``gather`` needs, worked
        out once (the properties of a spec cost microseconds each, per sample)."""
        offset = 0
        for spec in self.specs:
            self._offsets[spec.name] = offset
            if spec.nbytes:
                self._layout.append((spec.name, offset, spec.nbytes, spec.torch_dtype))
            offset += spec.nbytes
        self._nbytes = offset
        self._shapes = {spec.name: spec.shape for spec in self.specs}

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BatchConfig:
        """From ``{"specs": [{"name", "shape", "dtype"}, ...]}``."""
        if "specs" not in data:
            raise ValueError("BatchConfig.from_dict: missing key 'specs'")
        return cls(data["specs"])

    @classmethod
    def from_yaml(cls, path: str | Path) -> BatchConfig:
        """From a YAML file holding ``specs:`` at the top or under ``batch_config:``."""
        data = yaml.safe_load(Path(path).read_text())
        if isinstance(data, dict) and "batch_config" in data:
            data = data["batch_config"]
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping with a 'specs' list")
        return cls.from_dict(data)

    # ---------------------------------------------------------------- properties
    def nbytes(self) -> int:
        """Bytes of one encoded sample."""
        return self._nbytes

    def offset_of(self, name: str) -> int:
        """Where tensor ``name``'s bytes start in an encoded sample (specs packed back to back)."""
        return self._offsets[name]

    @property
    def tensor_names(self) -> list[str]:
        return [s.name for s in self.specs]

    def get_spec(self, name: str) -> TensorSpec:
        for spec in self.specs:
            if spec.name == name:
                return spec
        raise KeyError(f"no tensor named {name!r}; have {self.tensor_names}")

    def to_dict(self) -> dict[str, Any]:
        return {"specs": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype}
                          for s in self.specs]}

    # ---------------------------------------------------------------- codec
    def encode(self, **tensors: torch.Tensor) -> bytes:
        """Pack the named tensors into new ``bytes`` with one copy: ``bytes.join`` over the
        tensors' own bytes (a zeroed buffer written and then copied into ``bytes`` cost a
        README worker two more passes over every sample: 4 MiB samples, 3x the fill), and
        no conversion call for a tensor that is already a contiguous CPU tensor of its
        spec's dtype (4 KiB samples: 4.4 us a sample against 6.7 us before, loaded machine)."""
        if tensors.keys() != self._shapes.keys():
            self._check_names(tensors, "encode")
        for name, shape in self._shapes.items():
            if tensors[name].shape != shape:
                raise ValueError(f"tensor {name!r}: shape {tuple(tensors[name].shape)} != spec {shape}")
        parts = []
        for name, _, _, dtype in self._layout:
            src = tensors[name]
            if src.dtype is not dtype or src.requires_grad or src.device.type != "cpu" or not src.is_contiguous():
                src = src.detach().to("cpu", dtype).contiguous()
            flat = src.reshape(-1)
            parts.append((flat if dtype.itemsize == 1 else flat.view(torch.uint8)).numpy())
        payload = encode_sink.take_slot(self._nbytes)
        if payload is not None:  # a worker's generator_fn is filling this slot
            return self._encode_into(payload, parts)
        return parts[0].tobytes() if len(parts) == 1 else b"".join(parts)

    def _encode_into(self, payload: memoryview, parts: list) -> memoryview:
        """``encode`` into the slot a worker's generator is filling (``encode_sink.py``): the
        same bytes, each tensor's written straight into place; returns a read-only view of
        the sample there."""
        for (_, offset, nbytes, _), part in zip(self._layout, parts, strict=True):
            payload[offset:offset + nbytes] = part
        view = payload[:self._nbytes].toreadonly()
        encode_sink.note_written(view)
        return view

    def _check_names(self, tensors: Mapping[str, torch.Tensor], what: str) -> None:
        missing = {s.name for s in self.specs} - set(tensors)
        extra = set(tensors) - {s.name for s in self.specs}
        if missing or extra:
            raise ValueError(f"BatchConfig.{what}: missing {sorted(missing)}, unexpected {sorted(extra)}")

    def write(self, buf: Buffer, **tensors: torch.Tensor) -> None:
        """Copy the named tensors straight into ``buf`` (at least ``nbytes()`` long)."""
        self._check_names(tensors, "write")
        views = self.decode(buf)
        for name, view in views.items():
            src = tensors[name]
            if tuple(src.shape) != tuple(view.shape):
                raise ValueError(f"tensor {name!r}: shape {tuple(src.shape)} != spec {tuple(view.shape)}")
            view.copy_(src)

    def copy_into(self, views: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy ``tensors`` into ``views`` (what :meth:`decode` made of a writable buffer),
        one copy per tensor and no intermediate bytes: a worker's ``generator_fn`` that
        returns its tensors lands here (against ``encode`` and the copy of its bytes into
        the slot, two passes over every sample fewer).

        Strict where ``encode`` converts: every name of the config and no other, each a
        ``torch.Tensor`` of its spec's shape and dtype; the first that is not raises a
        ValueError naming it, before anything is written. A silent conversion would hide
        a teacher that makes float32 for a bfloat16 slot (and cost a pass of its own).
        Tensors of at least ``LARGE_ROW_BYTES`` on the CPU go through ``memmove``, like the
        student's own copy (:func:`copy_rows`).
        """
        if not isinstance(tensors, Mapping) or tensors.keys() != self._shapes.keys():
            self._check_names(tensors if isinstance(tensors, Mapping) else {}, "copy_into")
        sources = []
        for name, _, _, dtype in self._layout:
            src = tensors[name]
            if not isinstance(src, torch.Tensor):
                raise ValueError(f"tensor {name!r}: got {type(src).__name__}, not a torch.Tensor")
            if src.shape != self._shapes[name]:
                raise ValueError(f"tensor {name!r}: shape {tuple(src.shape)} != spec {self._shapes[name]}")
            if src.dtype is not dtype:
                raise ValueError(f"tensor {name!r}: dtype {src.dtype} != spec {dtype}: convert it "
                                 f"(.to({dtype})) or change the BatchConfig")
            sources.append(src.detach() if src.requires_grad else src)  # no autograd history on the views
        for (name, _, nbytes, _), src in zip(self._layout, sources, strict=True):
            view = views[name]
            if nbytes >= LARGE_ROW_BYTES and src.device.type == "cpu" and src.is_contiguous() \
                    and view.is_contiguous():
                ctypes.memmove(view.data_ptr(), src.data_ptr(), nbytes)  # as in copy_rows: rep movsb
            else:
                view.copy_(src)

    def decode(self, data: Buffer) -> dict[str, torch.Tensor]:
        """Views of every tensor in ``data`` (no copy; writable if ``data`` is)."""
        return {spec.name: self._view(data, spec) for spec in self.specs}

    def gather(self, rows: torch.Tensor, index: torch.Tensor | Sequence[int], out: Mapping[str, torch.Tensor],
               start: int = 0) -> None:
        """Copy encoded samples ``rows[index]`` into ``out[name][start:start + len(index)]``.

        ``rows`` is a uint8 tensor with one encoded sample per row (``[N, >= nbytes()]``,
        rows may be strided, e.g. the payloads of shared-memory slots); ``out`` holds
        contiguous batch tensors ``[B, *shape]``. Tensors of at least
        ``LARGE_ROW_BYTES`` a sample are copied with one ``memmove`` per sample straight
        between addresses, the others with one :func:`copy_rows` per tensor: with one
        or two large samples per call, slicing tensors would cost more than the rest of
        the student's bookkeeping.
        """
        picks = index.tolist() if isinstance(index, torch.Tensor) else list(index)
        count = len(picks)
        _check_rows(picks, rows.shape[0])
        batches = [self._gather_target(out, name, nbytes, dtype, start, count)
                   for name, _, nbytes, dtype in self._layout]  # all checked before anything is written
        direct = _memmove_source(rows)
        index_tensor = None
        for (_, offset, nbytes, _), batch in zip(self._layout, batches, strict=True):
            if direct and nbytes >= LARGE_ROW_BYTES and batch.device.type == "cpu" \
                    and offset + nbytes <= rows.shape[1]:
                _memmove_rows(rows, picks, offset, nbytes, batch.data_ptr() + start * nbytes)
                continue
            if index_tensor is None:
                index_tensor = torch.tensor(picks, dtype=torch.int64)
            copy_rows(rows[:, offset:offset + nbytes], index_tensor,
                      batch[start:start + count].view(torch.uint8).view(count, nbytes))

    def take(self, rows: torch.Tensor, index: Sequence[int]) -> dict[str, torch.Tensor]:
        """Encoded samples ``rows[index]`` copied into fresh batch tensors ``{name: [len(index), *shape]}``.

        ``gather``'s sibling for a new batch: one ``index_select`` per tensor into memory it
        allocates itself, so none of ``gather``'s checks of a given ``out`` (a chunk of four
        4 KiB samples: 10 us here against 27 us for ``torch.empty`` plus ``gather``)."""
        picks = list(index)
        _check_rows(picks, rows.shape[0])
        count = len(picks)
        index_tensor = torch.tensor(picks, dtype=torch.int64)
        out = {spec.name: torch.empty((count, *spec.shape), dtype=spec.torch_dtype) for spec in self.specs
               if not spec.nbytes}
        for name, offset, nbytes, dtype in self._layout:
            flat = torch.index_select(rows[:, offset:offset + nbytes], 0, index_tensor)
            out[name] = flat.view(dtype).view(count, *self._shapes[name])
        return {spec.name: out[spec.name] for spec in self.specs}

    @staticmethod
    def _gather_target(out: Mapping[str, torch.Tensor], name: str, nbytes: int, dtype: torch.dtype,
                       start: int, count: int) -> torch.Tensor:
        """``out[name]``, checked to take ``count`` samples of ``nbytes`` from row ``start``."""
        batch = out[name]
        if not batch.is_contiguous() or batch.dtype != dtype or batch.dim() == 0:
            raise ValueError(f"gather: out[{name!r}] must be a contiguous {dtype} batch")
        if batch.numel() * batch.element_size() != batch.shape[0] * nbytes:
            raise ValueError(f"gather: out[{name!r}] has rows of {tuple(batch.shape[1:])}, not the spec's")
        if not 0 <= start <= start + count <= batch.shape[0]:
            raise ValueError(f"gather: rows {start}..{start + count} outside out[{name!r}] "
                             f"({batch.shape[0]} rows)")
        return batch

    def decode_single(self, data: Buffer, name: str) -> torch.Tensor:
        """A view of one tensor in ``data``."""
        return self._view(data, self.get_spec(name))

    def _view(self, data: Buffer, spec: TensorSpec) -> torch.Tensor:
        if len(data) < self._nbytes:
            raise ValueError(f"buffer of {len(data)} bytes is shorter than the sample ({self._nbytes})")
        if spec.nbytes == 0:
            return torch.empty(spec.shape, dtype=spec.torch_dtype)
        offset = self._offsets[spec.name]
        flat = torch.frombuffer(_writable(data), dtype=torch.uint8, count=spec.nbytes, offset=offset)
        return flat.view(spec.torch_dtype).view(spec.shape)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BatchConfig) and self.specs == other.specs

    def __hash__(self) -> int:
        return hash(tuple(self.specs))

    def __repr__(self) -> str:
        return f"BatchConfig({self.specs!r})"


LARGE_ROW_BYTES = 1 << 20
"""Rows of at least this many bytes are copied one ``memmove`` each (see :func:`copy_rows`)."""


def copy_rows(src: torch.Tensor, index: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst[i] = src[index[i]]`` for uint8 CPU matrices: the student's one copy per sample.

    Large rows (>= ``LARGE_ROW_BYTES``) go through the C library's ``memmove``: on the
    x86 machines we measured, it copies a 4 MiB row about 10% faster than torch's
    vectorized loop alone and about 13% faster while teacher workers write into other
    slots at the same time (``bench/pipeline.py``), because it moves the bytes with
    ``rep movsb``. Smaller rows, and anything that is not a plain CPU byte matrix, take
    one ``index_select`` (a Python call per row would cost more than it saves).
    """
    count, width = dst.shape
    if width < LARGE_ROW_BYTES or not _memmove_ok(src, dst):
        torch.index_select(src, 0, index, out=dst)
        return
    rows = index.tolist()
    _check_rows(rows, src.shape[0])
    _memmove_rows(src, rows, 0, width, dst.data_ptr())


def _check_rows(rows: list[int], count: int) -> None:
    """Every row index inside ``[0, count)`` (raw copies do not check their addresses)."""
    if rows and (min(rows) < 0 or max(rows) >= count):
        raise IndexError(f"row index outside [0, {count}): {rows}")


def _memmove_rows(src: torch.Tensor, rows: list[int], offset: int, width: int, dst_ptr: int) -> None:
    """Bytes ``offset:offset + width`` of ``src[rows[i]]`` to ``dst_ptr + i * width``, one
    ``memmove`` each. Everything is checked by the caller: ``src`` passed
    :func:`_memmove_source` and is wide enough, ``rows`` passed :func:`_check_rows`, and
    the destination holds ``len(rows) * width`` bytes."""
    src_ptr, src_stride = src.data_ptr() + offset, src.stride(0)
    for i, row in enumerate(rows):
        ctypes.memmove(dst_ptr + i * width, src_ptr + row * src_stride, width)


def _memmove_source(src: torch.Tensor) -> bool:
    """A CPU byte matrix whose rows are each contiguous in memory."""
    return src.device.type == "cpu" and src.dtype == torch.uint8 and src.dim() == 2 and src.stride(1) == 1


def _memmove_ok(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Both byte matrices on the CPU, rows of equal width, each row contiguous in memory."""
    return (_memmove_source(src) and dst.device.type == "cpu" and dst.dtype == torch.uint8 and dst.dim() == 2
            and src.shape[1] == dst.shape[1] and dst.is_contiguous())


def _as_spec(spec: TensorSpec | Mapping[str, Any]) -> TensorSpec:
    if isinstance(spec, TensorSpec):
        return spec
    if isinstance(spec, Mapping):
        try:
            return TensorSpec(str(spec["name"]), tuple(spec["shape"]), str(spec["dtype"]))
        except KeyError as exc:
            raise ValueError(f"tensor spec {dict(spec)} is missing key {exc}") from None
    raise ValueError(f"expected a TensorSpec or a mapping, got {type(spec).__name__}")


def _writable(data: Buffer) -> Buffer:
    """torch.frombuffer warns on read-only buffers; copy-free for writable ones."""
    if isinstance(data, bytes):
        return bytearray(data)  # bytes are immutable: decoding them costs one copy
    return data
