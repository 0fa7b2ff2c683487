"""The slot header: what makes a filled slot checkable by the student that owns it.

Every slot of every medium starts with a fixed 64-byte header written by the worker
*after* the payload (so a header that checks out means the payload before it is
complete). The student clears the header before it asks for the slot to be filled,
and accepts the slot only when magic, version, generation, request id and length
are exactly what it asked for. A stale (old generation), foreign (other request)
or torn (header not yet written) slot is never yielded.

Byte layout of one slot (little endian)::

    offset  size  field
    0       4     magic        b"DSLT"
    4       2     version      SLOT_VERSION
    6       2     flags        bit 0: checksum present
    8       8     generation   model generation the payload was made for
    16      8     request_id   the student's id for this fill
    24      8     payload_len  bytes of payload that follow the header
    32      4     checksum     zlib.crc32 of the payload (when flag bit 0)
    36      28    reserved     zero
    64      ...   payload      payload_len bytes (the BatchConfig encoding)
    ...           padding      up to the slot stride (a multiple of SLOT_ALIGN)

Each function comes in two forms: one slot (``write_header``, ``check_slot``, ...)
and many slots at once through a :func:`header_table`, a strided NumPy view of
every header of a segment (``write_headers``, ``check_slots``, ``clear_headers``).
The table form is what the hot paths use: a REQUEST, WORK or COMPLETE of hundreds
of slots costs a few NumPy calls instead of hundreds of Python ones. A
:class:`HeaderTable` picks between the two by count: NumPy's fixed cost (about
15 us to check one slot, 5 us to write one) is most of a large sample's
bookkeeping, where a message carries one slot; ``struct`` does one in 0.3 us.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SLOT_MAGIC = b"DSLT"
SLOT_VERSION = 1
HEADER_BYTES = 64
SLOT_ALIGN = 64
FLAG_CHECKSUM = 1

_HEADER = struct.Struct("<4sHHQQQI")
_CHECKED = struct.Struct("<4sHHQQQ")  # the fields check_slots compares, flags included
_WHOLE = struct.Struct(f"<4sHHQQQI{HEADER_BYTES - _HEADER.size}x")  # reserved bytes zeroed
HEADER_DTYPE = np.dtype({
    "names": ["magic", "version", "flags", "generation", "request_id", "payload_len", "checksum"],
    "formats": ["S4", "<u2", "<u2", "<u8", "<u8", "<u8", "<u4"],
    "offsets": [0, 4, 6, 8, 16, 24, 32],
    "itemsize": HEADER_BYTES,
})
_RAW_HEADER = np.dtype((np.void, HEADER_BYTES))  # all 64 bytes, reserved ones included


@dataclass(frozen=True, slots=True)
class SlotHeader:
    generation: int
    request_id: int
    payload_len: int
    checksum: int | None = None


def slot_stride(payload_bytes: int) -> int:
    """Bytes one slot takes for a payload of ``payload_bytes``: header + payload, aligned."""
    raw = HEADER_BYTES + payload_bytes
    return (raw + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def write_header(buf: memoryview, header: SlotHeader) -> None:
    """Commit a slot: write the header (call after the payload is in place)."""
    flags = 0 if header.checksum is None else FLAG_CHECKSUM
    _HEADER.pack_into(buf, 0, SLOT_MAGIC, SLOT_VERSION, flags, header.generation,
                      header.request_id, header.payload_len, header.checksum or 0)


def clear_header(buf: memoryview) -> None:
    """Invalidate a slot before asking for it to be filled again."""
    buf[:HEADER_BYTES] = bytes(HEADER_BYTES)


def read_header(buf: memoryview) -> SlotHeader | None:
    """The header at the start of ``buf``, or None when the slot holds no valid header."""
    magic, version, flags, generation, request_id, payload_len, checksum = _HEADER.unpack_from(buf, 0)
    if magic != SLOT_MAGIC or version != SLOT_VERSION:
        return None
    return SlotHeader(generation, request_id, payload_len,
                      checksum if flags & FLAG_CHECKSUM else None)


def payload_checksum(payload: memoryview) -> int:
    return zlib.crc32(payload) & 0xFFFFFFFF


def check_slot(buf: memoryview, generation: int, request_id: int, payload_len: int) -> str | None:
    """Why the slot does not hold the asked-for sample, or None when it does."""
    header = read_header(buf)
    if header is None:
        return "no valid header (slot not written or torn)"
    if header.generation != generation:
        return f"generation {header.generation} != {generation}"
    if header.request_id != request_id:
        return f"request id {header.request_id} != {request_id}"
    if header.payload_len != payload_len:
        return f"payload length {header.payload_len} != {payload_len}"
    if header.checksum is not None:
        actual = payload_checksum(buf[HEADER_BYTES:HEADER_BYTES + payload_len])
        if actual != header.checksum:
            return f"checksum {actual:#x} != {header.checksum:#x}"
    return None


# --------------------------------------------------------------------------- many slots
def header_table(buf: memoryview, stride: int) -> np.ndarray:
    """The headers of every whole slot of ``buf`` as one record array (a view:
    writable when ``buf`` is). Row ``i`` is the header at byte ``i * stride``."""
    if stride < HEADER_BYTES:
        raise ValueError(f"stride {stride} is smaller than the {HEADER_BYTES}-byte header")
    return np.ndarray((len(buf) // stride,), dtype=HEADER_DTYPE, buffer=buf, strides=(stride,))


def write_headers(table: np.ndarray, slot_idxs: Sequence[int], generation: int,
                  request_ids: Sequence[int], payload_lens: Sequence[int] | int,
                  checksums: Sequence[int] | None = None) -> None:
    """Commit many slots (call after their payloads are in place)."""
    records = np.zeros(len(slot_idxs), dtype=HEADER_DTYPE)
    records["magic"] = SLOT_MAGIC
    records["version"] = SLOT_VERSION
    records["generation"] = generation
    records["request_id"] = request_ids
    records["payload_len"] = payload_lens
    if checksums is not None:
        records["flags"] = FLAG_CHECKSUM
        records["checksum"] = checksums
    table[np.asarray(slot_idxs, dtype=np.intp)] = records


def clear_headers(table: np.ndarray, slot_idxs: Sequence[int]) -> None:
    """Invalidate many slots before asking for them to be filled again (zero their headers)."""
    table.view(_RAW_HEADER)[np.asarray(slot_idxs, dtype=np.intp)] = bytes(HEADER_BYTES)


def check_slots(table: np.ndarray, slot_idxs: Sequence[int], generation: int,
                request_ids: Sequence[int], payload_len: int) -> np.ndarray:
    """For each slot, True when its header is exactly the one asked for and carries
    no checksum. A False slot is not necessarily bad: ask :func:`check_slot` (which
    also verifies checksums, and says what is wrong)."""
    headers = table[np.asarray(slot_idxs, dtype=np.intp)]
    return ((headers["magic"] == SLOT_MAGIC) & (headers["version"] == SLOT_VERSION)
            & (headers["flags"] & FLAG_CHECKSUM == 0) & (headers["generation"] == generation)
            & (headers["request_id"] == np.asarray(request_ids, dtype=np.uint64))
            & (headers["payload_len"] == payload_len))


FEW_SLOTS = 8
"""Up to this many slots, a :class:`HeaderTable` handles slots one ``struct`` call
each; above it, with the NumPy table functions."""


class HeaderTable:
    """The headers of every slot of a segment, read and written in place.

    The same results as the table functions (``check_slots``, ``clear_headers``,
    ``write_headers``, which it uses for many slots), at a fraction of their fixed
    cost for the one or few slots a message of large samples carries.
    """

    def __init__(self, buf: memoryview, stride: int) -> None:
        self.records = header_table(buf, stride)
        """The NumPy record view (every header's fields by name)."""
        self._buf = buf
        self._stride = stride
        self._count = len(self.records)

    def __len__(self) -> int:
        return self._count

    def check(self, slot_idxs: Sequence[int], generation: int, request_ids: Sequence[int],
              payload_len: int) -> list[bool]:
        """:func:`check_slots`, as a list."""
        if len(slot_idxs) > FEW_SLOTS:
            return check_slots(self.records, slot_idxs, generation, request_ids, payload_len).tolist()
        matches = []
        for slot, request_id in zip(slot_idxs, request_ids, strict=True):
            magic, version, flags, gen, req, length = _CHECKED.unpack_from(self._buf, self._offset(slot))
            matches.append(magic == SLOT_MAGIC and version == SLOT_VERSION and not flags & FLAG_CHECKSUM
                           and gen == generation and req == request_id and length == payload_len)
        return matches

    def clear(self, slot_idxs: Sequence[int]) -> None:
        """:func:`clear_headers`."""
        if len(slot_idxs) > FEW_SLOTS:
            clear_headers(self.records, slot_idxs)
            return
        for slot in slot_idxs:
            offset = self._offset(slot)
            self._buf[offset:offset + HEADER_BYTES] = _ZERO_HEADER

    def write(self, slot_idxs: Sequence[int], generation: int, request_ids: Sequence[int],
              payload_lens: Sequence[int] | int, checksums: Sequence[int] | None = None) -> None:
        """:func:`write_headers`."""
        if len(slot_idxs) > FEW_SLOTS:
            write_headers(self.records, slot_idxs, generation, request_ids, payload_lens, checksums)
            return
        lens = [payload_lens] * len(slot_idxs) if isinstance(payload_lens, int) else payload_lens
        flags = 0 if checksums is None else FLAG_CHECKSUM
        for i, (slot, request_id, length) in enumerate(zip(slot_idxs, request_ids, lens, strict=True)):
            _WHOLE.pack_into(self._buf, self._offset(slot), SLOT_MAGIC, SLOT_VERSION, flags, generation,
                             request_id, length, 0 if checksums is None else checksums[i])

    def request_id(self, slot: int) -> int:
        """The request id in a slot's header (0 when cleared)."""
        return _CHECKED.unpack_from(self._buf, self._offset(slot))[4]

    def _offset(self, slot: int) -> int:
        """Where a slot's header starts; IndexError outside the table (as NumPy's)."""
        if not 0 <= slot < self._count:
            raise IndexError(f"slot {slot} outside [0, {self._count})")
        return slot * self._stride


_ZERO_HEADER = bytes(HEADER_BYTES)
