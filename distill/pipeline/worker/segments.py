"""The student segments a worker writes into: mapped once, checked on every use.

A worker takes a segment's geometry (slot count, stride, sample size) from the header
its owner wrote into it (``slot.py``), never from a request: an item whose stride or
slot index does not match that header is refused, so no REQUEST, WORK or DIRECT can
make a worker write across a slot boundary of someone's segment. Before each batch it
asks the kernel whether the mapped file is still the one the name refers to
(``AttachedSegment.current``): a stale map is mapped again, never written through.

A student can shrink its own segment under the mapping (a SIGBUS in the worker). So
before each step that touches a segment (its claims, the sample function, a deferred
batch's ``finish``, the commit; see ``fill.py``, ``commit.py``, ``batches.py``) the worker
checks the file's size (:meth:`Segments.check_size`, one ``fstat``); a segment found
shrunk is refused (its items fail with the reason), grown back to its mapped size so
copies in flight land in the file (``AttachedSegment.restore_size``), and dropped. What
this leaves open and why: docs/security.md, section Other users' files and hostile
students.

Each slot's payload view and decoded tensors are made once, the first time the slot
is filled, and serve every later fill of that slot. The worker's claims on a segment
(``claims.py``) are counted here, against the segment's ``max_claims``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from distill.pipeline.mediums.shm import SHM_DIR, AttachedSegment, attach_segment
from distill.pipeline.mediums.tcp import is_tcp_medium, parse_medium
from distill.pipeline.slot import HEADER_BYTES, HeaderTable, read_max_claims
from distill.pipeline.throttle import LogThrottle

log = logging.getLogger(__name__)

MAX_ATTACHED_SEGMENTS = 256
SEGMENT_RECHECK_S = 5.0
"""How often segments whose owner is gone are unmapped (so their memory can be freed)."""

SlotViews = tuple[memoryview, dict[str, torch.Tensor] | None]
Decoder = Callable[[memoryview], dict[str, torch.Tensor]]


@dataclass
class Segment:
    """An attached student segment, and what was made of it once per slot."""

    attached: AttachedSegment
    view: memoryview
    """The slots (not the segment header behind them)."""
    table: HeaderTable
    whole: memoryview
    slots: dict[int, SlotViews] = field(default_factory=dict)
    """slot_idx -> the slot's payload view and decoded tensors."""
    claimed: int = 0
    """Slots this worker has claimed here and not yet committed or given up."""
    medium: str = ""
    """The medium name it is mapped under (the key of ``Segments``)."""
    dropped: str | None = None
    """Why it was dropped (no longer written), once it was."""

    @property
    def stride(self) -> int:
        return self.attached.header.stride

    @property
    def slot_count(self) -> int:
        return self.attached.header.slot_count

    @property
    def payload_bytes(self) -> int:
        """The sample size the owner declared (0: not declared)."""
        return self.attached.header.payload_bytes

    def room(self) -> int | None:
        """Slots this worker may still claim here (None: no limit), by the owner's rule."""
        max_claims = read_max_claims(self.whole)
        return None if max_claims == 0 else max(0, max_claims - self.claimed)


class Segments:
    """The segments this worker has mapped, least recently used first."""

    def __init__(self, slot_size: int, decode: Decoder | None) -> None:
        self.slot_size = slot_size
        self._decode = decode
        self._segments: OrderedDict[str, Segment] = OrderedDict()
        self._checked = time.monotonic()
        self._shrinks = LogThrottle(log)

    def __contains__(self, medium: str) -> bool:
        return medium in self._segments

    def get(self, medium: str) -> Segment | None:
        return self._segments.get(medium)

    def fresh(self, medium: str) -> Segment:
        """The segment of ``medium``, mapped now or earlier but still the named file."""
        segment = self._segments.get(medium)
        if segment is not None and not segment.attached.current():
            self.forget(medium)  # its owner unlinked it: the name may be a new owner's by now
            segment = None
        if segment is not None and (why := self.check_size(segment)) is not None:
            raise ShrunkSegmentError(why)  # (its claims are read and written next)
        if segment is None:
            segment = self._attach(medium)
            while len(self._segments) > MAX_ATTACHED_SEGMENTS:
                self.forget(next(iter(self._segments)))
        self._segments.move_to_end(medium)
        return segment

    def _attach(self, medium: str) -> Segment:
        expected = None
        name = medium
        if is_tcp_medium(medium):
            address = parse_medium(medium)
            name, expected = address.segment, (address.st_dev, address.st_ino)
        attached = attach_segment(name)
        if expected is not None and attached.identity != expected:
            attached.close()
            raise PermissionError(f"refusing to attach {name!r}: not the file the network medium names")
        whole = memoryview(attached.mapping)
        header = attached.header
        if header.payload_bytes and header.payload_bytes != self.slot_size:
            whole.release()
            attached.close()
            raise ValueError(f"the student's slots hold {header.payload_bytes}-byte samples, this worker makes "
                             f"{self.slot_size}-byte ones: give workers and students the same batch_config")
        if HEADER_BYTES + self.slot_size > header.stride:
            whole.release()
            attached.close()
            raise ValueError(f"the segment's {header.stride}-byte slots cannot hold the header and a "
                             f"{self.slot_size}-byte sample")
        view = whole[:header.slots_bytes]
        segment = Segment(attached, view, HeaderTable(view[:], header.stride), whole, medium=medium)
        self._segments[medium] = segment
        return segment

    def slot(self, segment: Segment, slot_idx: int, stride: int) -> SlotViews:
        """Check a slot's address against the segment's own header; decode its views once."""
        views = segment.slots.get(slot_idx)
        if views is not None and stride == segment.stride:
            return views
        if stride != segment.stride:
            raise ValueError(f"stride {stride} is not the segment's {segment.stride}")
        if not 0 <= slot_idx < segment.slot_count:
            raise IndexError(f"slot {slot_idx} outside the segment's {segment.slot_count} slots")
        start = slot_idx * stride + HEADER_BYTES
        payload = segment.view[start:start + self.slot_size]
        views = segment.slots[slot_idx] = payload, None if self._decode is None else self._decode(payload)
        return views

    def check_size(self, segment: Segment) -> str | None:
        """None while every mapped byte of ``segment`` is still in its file (or it was already
        dropped); else why nothing more may be written into it. A shrunk segment is grown
        back for writes under way, then dropped (module docstring)."""
        if segment.dropped is not None:
            return segment.dropped  # its views are not to be written any more
        size = segment.attached.file_size()
        if size >= segment.attached.size:
            return None
        segment.dropped = (f"segment shrank to {size} of its {segment.attached.size} bytes while mapped "
                           "(its owner truncated it): not written")
        self._shrinks.warning("worker: %s: %s", segment.attached.name, segment.dropped)
        segment.attached.restore_size()
        if self._segments.get(segment.medium) is segment:
            self.forget(segment.medium)
        return segment.dropped

    def reset_claims(self) -> bool:
        """Outside a batch this worker claims nothing: zero every count; True if one was not."""
        stale = [segment for segment in self._segments.values() if segment.claimed]
        for segment in stale:
            segment.claimed = 0
        return bool(stale)

    def drop_unlinked(self) -> None:
        """Unmap segments whose owner unlinked them, at most every SEGMENT_RECHECK_S."""
        if time.monotonic() - self._checked < SEGMENT_RECHECK_S:
            return
        self._checked = time.monotonic()
        for medium in [m for m, segment in self._segments.items() if not segment.attached.current()]:
            self.forget(medium)

    def forget(self, medium: str) -> None:
        segment = self._segments.pop(medium)
        segment.dropped = segment.dropped or "segment unmapped"
        segment.slots.clear()
        segment.table = None
        for view in (segment.view, segment.whole):
            with contextlib.suppress(BufferError):
                view.release()
        segment.attached.close()

    def close(self) -> None:
        for medium in list(self._segments):
            self.forget(medium)


class ShrunkSegmentError(ValueError):
    """A mapped segment's file is smaller than the mapping: refused, never written."""


def segment_exists(segment: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, segment))
