"""The slot header and the segment header: what makes a filled slot checkable.

Every slot of every medium starts with a fixed 64-byte header. The student writes
``fill`` (the request id it asks for) when it asks, zeroing the rest; a worker writes
``claim`` *before* the payload and the commit fields *after* it, so a header that
checks out means the payload before it is complete. A slot is accepted only when its
commit is exactly what was asked for and is the claimed writer's (``writer == claim``,
``fill == request_id``). See docs/pipeline.md, section Flow.

Byte layout of one slot (little endian)::

    offset  size  field        written by
    0       4     magic        worker, at commit   b"DSLT"
    4       2     version      worker, at commit   SLOT_VERSION
    6       2     flags        worker, at commit   bit 0: checksum present
    8       8     generation   worker, at commit   model generation the payload was made for
    16      8     request_id   worker, at commit   the student's id for this fill
    24      8     payload_len  worker, at commit   bytes of payload that follow the header
    32      4     checksum     worker, at commit   zlib.crc32 of the payload (when flag bit 0)
    36      4     reserved                         zero
    40      8     writer       worker, at commit   the writer id of the committer
    48      8     claim        worker, at claim    the writer id that took this fill (0: none)
    56      8     fill         student, at ask     the request id the slot waits for
    64      ...   payload      payload_len bytes (the BatchConfig encoding)
    ...           padding      up to the slot stride (a multiple of SLOT_ALIGN)

The claim is the slot's *one writer* (rules in ``worker/claims.py``): a student reads
it to tell a slot someone may be writing (leave it alone) from one nobody will (ask
again).

Behind the last slot of a shared-memory segment the owner writes a *segment header*
(:class:`SegmentHeader`, 64 bytes) with the slots' geometry: a worker takes the slot
count and stride from it, never from a request, so no message can make it write
across a slot boundary of a segment it maps. Its ``nonce`` tells two segments of one
name apart (a name recycled by a new owner), and ``max_claims`` is the owner's rule
for how many of its slots one writer may hold at once (its fair share)::

    offset  size  field
    0       4     magic          b"DSEG"
    4       2     version        SEGMENT_VERSION
    6       2     reserved
    8       8     slot_count
    16      8     stride
    24      8     payload_bytes  the sample size the owner expects (0: not declared)
    32      8     max_claims     slots one writer may claim at once (0: no limit)
    40      4     owner_pid
    44      4     reserved
    48      16    nonce          random, per segment

Each slot function comes in two forms: one slot (``write_header``, ``check_slot``,
...) and many slots at once through a :func:`header_table`, a strided NumPy view of
every header of a segment (``write_headers``, ``check_slots``, ``ask_headers``). A
:class:`HeaderTable` picks between the two by count: NumPy's fixed cost (about 15 us
to check one slot, 5 us to write one) is most of a large sample's bookkeeping, where
a message carries one slot; ``struct`` does one in 0.3 us.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SLOT_MAGIC = b"DSLT"
SLOT_VERSION = 2
"""2: the writer, claim and fill fields (version 1 had 28 reserved bytes there)."""
HEADER_BYTES = 64
SLOT_ALIGN = 64
FLAG_CHECKSUM = 1
COMMIT_BYTES = 48
"""The bytes a commit writes: magic ... writer (never the claim or the fill)."""

_COMMIT = struct.Struct("<4sHHQQQI4xQ")  # magic ... writer, reserved bytes zeroed
_CHECKED = struct.Struct("<4sHHQQQ4x4xQQQ")  # what a check compares, flags included
_CLAIM_OFFSET, _FILL_OFFSET = 48, 56
_U64 = struct.Struct("<Q")
_CLAIM_FILL = struct.Struct("<QQ")
HEADER_DTYPE = np.dtype({
    "names": ["magic", "version", "flags", "generation", "request_id", "payload_len", "checksum",
              "writer", "claim", "fill"],
    "formats": ["S4", "<u2", "<u2", "<u8", "<u8", "<u8", "<u4", "<u8", "<u8", "<u8"],
    "offsets": [0, 4, 6, 8, 16, 24, 32, 40, 48, 56],
    "itemsize": HEADER_BYTES,
})
_COMMIT_FIELDS = ["magic", "version", "flags", "generation", "request_id", "payload_len", "checksum", "writer"]
"""What a commit writes (a multi-field view of a table writes those bytes and no others)."""
_RAW_HEADER = np.dtype((np.void, HEADER_BYTES))  # all 64 bytes, reserved ones included


@dataclass(frozen=True, slots=True)
class SlotHeader:
    """The commit fields of a slot header."""

    generation: int
    request_id: int
    payload_len: int
    checksum: int | None = None
    writer: int = 0


def slot_stride(payload_bytes: int) -> int:
    """Bytes one slot takes for a payload of ``payload_bytes``: header + payload, aligned."""
    raw = HEADER_BYTES + payload_bytes
    return (raw + SLOT_ALIGN - 1) // SLOT_ALIGN * SLOT_ALIGN


def write_header(buf: memoryview, header: SlotHeader) -> None:
    """Commit a slot: write the commit fields (call after the payload is in place)."""
    flags = 0 if header.checksum is None else FLAG_CHECKSUM
    _COMMIT.pack_into(buf, 0, SLOT_MAGIC, SLOT_VERSION, flags, header.generation,
                      header.request_id, header.payload_len, header.checksum or 0, header.writer)


def write_claim(buf: memoryview, writer: int, fill: int) -> None:
    """Write the claim and fill fields of a slot (the staged slots of the network medium,
    whose header the remote worker makes whole: nobody else can write them)."""
    _CLAIM_FILL.pack_into(buf, _CLAIM_OFFSET, writer, fill)


def clear_header(buf: memoryview) -> None:
    """Invalidate a slot, claim and fill included."""
    buf[:HEADER_BYTES] = bytes(HEADER_BYTES)


def read_header(buf: memoryview) -> SlotHeader | None:
    """The commit fields at the start of ``buf``, or None when the slot holds no commit."""
    magic, version, flags, generation, request_id, payload_len, checksum, writer = _COMMIT.unpack_from(buf, 0)
    if magic != SLOT_MAGIC or version != SLOT_VERSION:
        return None
    return SlotHeader(generation, request_id, payload_len,
                      checksum if flags & FLAG_CHECKSUM else None, writer)


def read_claim(buf: memoryview) -> tuple[int, int]:
    """(claim, fill) of the slot at the start of ``buf``."""
    return _CLAIM_FILL.unpack_from(buf, _CLAIM_OFFSET)


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
    claim, fill = read_claim(buf)
    if fill != request_id:
        return f"the slot waits for fill {fill}, not {request_id}"
    if header.writer == 0 or header.writer != claim:
        return f"committed by writer {header.writer:#x}, claimed by {claim:#x}"
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


def _commit_view(table: np.ndarray) -> np.ndarray:
    """The commit fields of every header of ``table`` (writing it leaves claim and fill alone)."""
    return table[_COMMIT_FIELDS]


def write_headers(table: np.ndarray, slot_idxs: Sequence[int], generation: int,
                  request_ids: Sequence[int], payload_lens: Sequence[int] | int,
                  checksums: Sequence[int] | None = None, writer: int = 0) -> None:
    """Commit many slots (call after their payloads are in place)."""
    commits = _commit_view(table)
    records = np.zeros(len(slot_idxs), dtype=commits.dtype)
    records["magic"] = SLOT_MAGIC
    records["version"] = SLOT_VERSION
    records["generation"] = generation
    records["request_id"] = request_ids
    records["payload_len"] = payload_lens
    records["writer"] = writer
    if checksums is not None:
        records["flags"] = FLAG_CHECKSUM
        records["checksum"] = checksums
    commits[np.asarray(slot_idxs, dtype=np.intp)] = records


def clear_headers(table: np.ndarray, slot_idxs: Sequence[int]) -> None:
    """Zero whole headers (claim and fill included)."""
    table.view(_RAW_HEADER)[np.asarray(slot_idxs, dtype=np.intp)] = bytes(HEADER_BYTES)


def header_words(table: np.ndarray) -> np.ndarray:
    """The headers of ``table`` (made by :func:`header_table`) as rows of eight
    little-endian uint64 words (a view):
    0 magic|version|flags, 1 generation, 2 request_id, 3 payload_len, 4 checksum, 5
    writer, 6 claim, 7 fill. Whole-word comparisons and writes are what the hot paths do."""
    # (``table`` is non-contiguous, so the view is made over the buffer it was made over.)
    return np.ndarray((len(table), 8), dtype="<u8", buffer=table.base, offset=0, strides=(table.strides[0], 8))


_COMMITTED_WORD0 = int.from_bytes(SLOT_MAGIC + SLOT_VERSION.to_bytes(2, "little") + bytes(2), "little")
"""Word 0 of a committed header without checksum: magic, version, flags 0."""


def ask_headers(table: np.ndarray, slot_idxs: Sequence[int], request_ids: Sequence[int],
                words: np.ndarray | None = None) -> None:
    """The student asks for fills: every field zero but ``fill``, each slot's request id."""
    rows = np.zeros((len(slot_idxs), 8), dtype="<u8")
    rows[:, 7] = request_ids
    (header_words(table) if words is None else words)[np.asarray(slot_idxs, dtype=np.intp)] = rows


def check_slots(table: np.ndarray, slot_idxs: Sequence[int], generation: int,
                request_ids: Sequence[int], payload_len: int, words: np.ndarray | None = None) -> np.ndarray:
    """For each slot, True when its header is exactly the one asked for (committed by
    its claimed writer, for that fill) and carries no checksum. A False slot is not
    necessarily bad: ask :func:`check_slot` (which also verifies checksums, and says
    what is wrong)."""
    h = (header_words(table) if words is None else words)[np.asarray(slot_idxs, dtype=np.intp)]
    reqs = np.asarray(request_ids, dtype=np.uint64)
    return ((h[:, 0] == _COMMITTED_WORD0) & (h[:, 1] == generation) & (h[:, 2] == reqs)
            & (h[:, 3] == payload_len) & (h[:, 7] == reqs) & (h[:, 5] == h[:, 6]) & (h[:, 5] != 0))


FEW_SLOTS = 8
"""Up to this many slots, a :class:`HeaderTable` handles slots one ``struct`` call
each; above it, with the NumPy table functions."""


class HeaderTable:
    """The headers of every slot of a segment, read and written in place.

    The same results as the table functions (``check_slots``, ``ask_headers``,
    ``write_headers``, which it uses for many slots), at a fraction of their fixed
    cost for the one or few slots a message of large samples carries.
    """

    def __init__(self, buf: memoryview, stride: int) -> None:
        self.records = header_table(buf, stride)
        """The NumPy record view (every header's fields by name)."""
        self.words = header_words(self.records)
        """The same headers as rows of eight uint64 words (``header_words``)."""
        self._buf = buf
        self._stride = stride
        self._count = len(self.records)

    def __len__(self) -> int:
        return self._count

    def close(self) -> None:
        """Drop the views of the segment (so that it can be unmapped); the table is unusable after."""
        self.records = self.words = self._buf = None

    # ---------------------------------------------------------------- the student's side
    def check(self, slot_idxs: Sequence[int], generation: int, request_ids: Sequence[int],
              payload_len: int) -> list[bool]:
        """:func:`check_slots`, as a list."""
        if len(slot_idxs) > FEW_SLOTS:
            return check_slots(self.records, slot_idxs, generation, request_ids, payload_len, self.words).tolist()
        matches = []
        for slot, request_id in zip(slot_idxs, request_ids, strict=True):
            magic, version, flags, gen, req, length, writer, claim, fill = _CHECKED.unpack_from(
                self._buf, self._offset(slot))
            matches.append(magic == SLOT_MAGIC and version == SLOT_VERSION and not flags & FLAG_CHECKSUM
                           and gen == generation and req == request_id and length == payload_len
                           and fill == request_id and writer == claim and writer != 0)
        return matches

    def ask(self, slot_idxs: Sequence[int], request_ids: Sequence[int]) -> None:
        """:func:`ask_headers`: the slots wait for these fills, claimed by nobody."""
        if len(slot_idxs) > FEW_SLOTS:
            ask_headers(self.records, slot_idxs, request_ids, self.words)
            return
        for slot, request_id in zip(slot_idxs, request_ids, strict=True):
            offset = self._offset(slot)
            self._buf[offset:offset + _FILL_OFFSET] = _ZERO_HEADER[:_FILL_OFFSET]
            _U64.pack_into(self._buf, offset + _FILL_OFFSET, request_id)

    def clear(self, slot_idxs: Sequence[int]) -> None:
        """:func:`clear_headers`."""
        if len(slot_idxs) > FEW_SLOTS:
            clear_headers(self.records, slot_idxs)
            return
        for slot in slot_idxs:
            offset = self._offset(slot)
            self._buf[offset:offset + HEADER_BYTES] = _ZERO_HEADER

    def request_id(self, slot: int) -> int:
        """The request id of a slot's commit (0 when not committed)."""
        return _CHECKED.unpack_from(self._buf, self._offset(slot))[4]

    def header(self, slot: int) -> SlotHeader | None:
        """A slot's commit fields (None when not committed)."""
        return read_header(self._buf[self._offset(slot):])

    # ---------------------------------------------------------------- the writer's side
    def all_claimable(self, slot_idxs: Sequence[int], request_ids: Sequence[int], writer: int) -> bool:
        """True when every slot waits for its request id and is claimed by nobody, or by
        ``writer`` (the common case, checked at once; else look slot by slot: ``claims``)."""
        if len(slot_idxs) <= FEW_SLOTS:
            claims, fills = self.claims(slot_idxs)
            return all(fill == req and claim in (0, writer)
                       for req, claim, fill in zip(request_ids, claims, fills, strict=True))
        h = self.words[np.asarray(slot_idxs, dtype=np.intp)]
        return bool(((h[:, 7] == np.asarray(request_ids, dtype=np.uint64))
                     & ((h[:, 6] == 0) | (h[:, 6] == writer))).all())

    def standing(self, slot_idxs: Sequence[int], request_ids: Sequence[int], writer: int) -> list[bool]:
        """For each slot, whether ``writer`` claims it for the fill of its request id."""
        if len(slot_idxs) <= FEW_SLOTS:
            claims, fills = self.claims(slot_idxs)
            return [claim == writer and fill == req for req, claim, fill in zip(request_ids, claims, fills, strict=True)]
        h = self.words[np.asarray(slot_idxs, dtype=np.intp)]
        return ((h[:, 6] == writer) & (h[:, 7] == np.asarray(request_ids, dtype=np.uint64))).tolist()

    def claims(self, slot_idxs: Sequence[int]) -> tuple[list[int], list[int]]:
        """The (claim, fill) fields of the slots, as two lists."""
        if len(slot_idxs) > FEW_SLOTS:
            rows = self.records[np.asarray(slot_idxs, dtype=np.intp)]
            return rows["claim"].tolist(), rows["fill"].tolist()
        pairs = [_CLAIM_FILL.unpack_from(self._buf, self._offset(slot) + _CLAIM_OFFSET) for slot in slot_idxs]
        return [claim for claim, _ in pairs], [fill for _, fill in pairs]

    def set_claims(self, slot_idxs: Sequence[int], writer: int) -> None:
        """Write ``writer`` into the claim of the slots (0: give them up)."""
        if len(slot_idxs) > FEW_SLOTS:
            self.records["claim"][np.asarray(slot_idxs, dtype=np.intp)] = writer
            return
        for slot in slot_idxs:
            _U64.pack_into(self._buf, self._offset(slot) + _CLAIM_OFFSET, writer)

    def write(self, slot_idxs: Sequence[int], generation: int, request_ids: Sequence[int],
              payload_lens: Sequence[int] | int, checksums: Sequence[int] | None = None,
              writer: int = 0) -> None:
        """:func:`write_headers`: commit the slots (claim and fill stay as they are)."""
        if len(slot_idxs) > FEW_SLOTS:
            write_headers(self.records, slot_idxs, generation, request_ids, payload_lens, checksums, writer)
            return
        lens = [payload_lens] * len(slot_idxs) if isinstance(payload_lens, int) else payload_lens
        flags = 0 if checksums is None else FLAG_CHECKSUM
        for i, (slot, request_id, length) in enumerate(zip(slot_idxs, request_ids, lens, strict=True)):
            _COMMIT.pack_into(self._buf, self._offset(slot), SLOT_MAGIC, SLOT_VERSION, flags, generation,
                              request_id, length, 0 if checksums is None else checksums[i], writer)

    def _offset(self, slot: int) -> int:
        """Where a slot's header starts; IndexError outside the table (as NumPy's)."""
        if not 0 <= slot < self._count:
            raise IndexError(f"slot {slot} outside [0, {self._count})")
        return slot * self._stride


_ZERO_HEADER = bytes(HEADER_BYTES)


# --------------------------------------------------------------------------- segment header
SEGMENT_MAGIC = b"DSEG"
SEGMENT_VERSION = 1
SEGMENT_HEADER_BYTES = 64
_SEGMENT = struct.Struct("<4sH2xQQQQI4x16s")
_MAX_CLAIMS_OFFSET = 32


@dataclass(frozen=True, slots=True)
class SegmentHeader:
    """The geometry of a segment's slots, as its owner wrote it (module docstring)."""

    slot_count: int
    stride: int
    payload_bytes: int = 0
    max_claims: int = 0
    owner_pid: int = 0
    nonce: bytes = bytes(16)

    @property
    def slots_bytes(self) -> int:
        return self.slot_count * self.stride


def segment_bytes(slot_count: int, stride: int) -> int:
    """Bytes of a segment of ``slot_count`` slots of ``stride`` bytes, its header included."""
    return slot_count * stride + SEGMENT_HEADER_BYTES


def write_segment_header(buf: memoryview, header: SegmentHeader) -> None:
    """Write the segment header at the end of ``buf`` (the whole segment)."""
    _SEGMENT.pack_into(buf, len(buf) - SEGMENT_HEADER_BYTES, SEGMENT_MAGIC, SEGMENT_VERSION,
                       header.slot_count, header.stride, header.payload_bytes, header.max_claims,
                       header.owner_pid, header.nonce)


def read_segment_header(buf: memoryview) -> SegmentHeader:
    """The segment header at the end of ``buf``, checked against its size; ValueError
    (saying what is wrong) when there is none or it does not describe ``buf``."""
    if len(buf) < SEGMENT_HEADER_BYTES:
        raise ValueError(f"a {len(buf)}-byte segment has no room for its {SEGMENT_HEADER_BYTES}-byte header")
    magic, version, count, stride, payload, max_claims, pid, nonce = _SEGMENT.unpack_from(
        buf, len(buf) - SEGMENT_HEADER_BYTES)
    if magic != SEGMENT_MAGIC or version != SEGMENT_VERSION:
        raise ValueError(f"no segment header (magic {magic!r}, version {version}): not a distill "
                         "segment of this version")
    if stride < HEADER_BYTES or count < 1 or count * stride + SEGMENT_HEADER_BYTES != len(buf) \
            or payload > stride - HEADER_BYTES:
        raise ValueError(f"segment header says {count} slots x {stride} bytes (payload {payload}), "
                         f"the segment has {len(buf)} bytes")
    return SegmentHeader(count, stride, payload, max_claims, pid, nonce)


def set_max_claims(buf: memoryview, max_claims: int) -> None:
    """The owner changes how many of its slots one writer may claim at once."""
    _U64.pack_into(buf, len(buf) - SEGMENT_HEADER_BYTES + _MAX_CLAIMS_OFFSET, max_claims)


def read_max_claims(buf: memoryview) -> int:
    return _U64.unpack_from(buf, len(buf) - SEGMENT_HEADER_BYTES + _MAX_CLAIMS_OFFSET)[0]
