"""The Medium protocol: where workers write samples and students read them.

A student *owns* its medium (creates it, unlinks it). The broker only routes the
medium's name and a slot index; a worker resolves them to a writable slot with
``slot_view``. Every slot starts with the header of :mod:`distill.pipeline.slot`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Medium(Protocol):
    """What the pipeline needs from a medium (the seed README's protocol)."""

    @property
    def buf_name(self) -> str: ...

    @property
    def slot_count(self) -> int: ...

    @property
    def slot_stride(self) -> int: ...

    def read_slot_tensors(self, slot_id: int) -> bytes: ...

    def close(self) -> None: ...

    def unlink(self) -> None: ...


class MediumBase:
    """Shared behaviour for mediums backed by one contiguous writable buffer.

    Subclasses set ``self._buf`` (a writable memoryview over ``slot_count *
    slot_stride`` bytes) or override :meth:`slot_view`.
    """

    _buf: memoryview | None = None
    _slot_count: int = 0
    _slot_stride: int = 0

    @property
    def buf_name(self) -> str:
        raise NotImplementedError

    @property
    def slot_count(self) -> int:
        return self._slot_count

    @property
    def slot_stride(self) -> int:
        return self._slot_stride

    @property
    def nbytes(self) -> int:
        return self._slot_count * self._slot_stride

    def slot_view(self, slot_id: int) -> memoryview:
        """A writable view of one whole slot (header + payload), bounds-checked."""
        if self._buf is None:
            raise RuntimeError(f"medium {self.buf_name} is closed")
        if not 0 <= slot_id < self._slot_count:
            raise IndexError(f"slot {slot_id} outside [0, {self._slot_count})")
        start = slot_id * self._slot_stride
        return self._buf[start:start + self._slot_stride]

    def read_slot_tensors(self, slot_id: int) -> bytes:
        """A copy of one slot's bytes (use ``slot_view`` to avoid the copy)."""
        return bytes(self.slot_view(slot_id))

    def close(self) -> None:
        raise NotImplementedError

    def unlink(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
