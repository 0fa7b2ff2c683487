"""Writer claims: one writer per slot fill (the slot header's ``claim`` and ``fill``).

Before a worker writes any byte of a slot's payload it *claims* the slot, and it may
only when

- the slot's ``fill`` is the request id it was given (the student has not asked for
  the slot again since: a WORK that waited in a socket across a broker restart, or a
  DIRECT the student gave up on, finds another fill there and writes nothing);
- no other live writer claims it (a claim of a writer whose process is gone is
  taken over);
- the owner's fair share allows it: at most ``max_claims`` slots of one segment
  claimed at once by this writer (the rest wait for the worker's next batch).

It commits (writes the header's commit fields, ``slot.py``) only while its claim and
that fill still stand, and it gives up the claims of a batch it could not fill. A
student accepts only a commit whose ``writer`` is the slot's ``claim`` (``check_slots``).
So two workers handed the same fill (a request repeated across a broker restart) never
both write it, and a student can tell from a slot's claim whether someone may still
be writing it.

Refused items fail as ``"stale"`` (the broker answers DISCARDED; the student looks at
the slot's claim to decide between asking again and waiting for the writer).
"""

from __future__ import annotations

from collections.abc import Sequence

from distill.pipeline.liveness import writer_alive
from distill.pipeline.worker.segments import Segment

STALE = "stale"
"""The failure reason of an item the worker will not write (the broker answers DISCARDED)."""


def claim(segment: Segment, slot_idxs: Sequence[int], request_ids: Sequence[int], writer: int,
          limit: int | None) -> tuple[list[int], list[int], list[int]]:
    """Claim what may be claimed of these slots (positions into them): returns the
    positions claimed, those refused (another fill, or another live writer) and those
    over ``limit`` (left for later)."""
    table = segment.table
    if (limit is None or len(slot_idxs) <= limit) and table.all_claimable(slot_idxs, request_ids, writer):
        table.set_claims(slot_idxs, writer)  # the common case: every slot, at once
        segment.claimed += len(slot_idxs)
        return list(range(len(slot_idxs))), [], []
    claims, fills = table.claims(slot_idxs)
    taken, refused, later = [], [], []
    for pos, (request_id, held_by, fill) in enumerate(zip(request_ids, claims, fills, strict=True)):
        if fill != request_id or (held_by not in (0, writer) and writer_alive(held_by) is not False):
            refused.append(pos)
        elif limit is not None and len(taken) >= limit:
            later.append(pos)
        else:
            taken.append(pos)
    if taken:
        segment.table.set_claims([slot_idxs[pos] for pos in taken], writer)
        segment.claimed += len(taken)
    return taken, refused, later


def still_claimed(segment: Segment, slot_idxs: Sequence[int], request_ids: Sequence[int],
                  writer: int) -> list[bool]:
    """For each slot, whether this writer's claim and the fill it was given still stand."""
    return segment.table.standing(slot_idxs, request_ids, writer)


def give_up(segment: Segment, slot_idxs: Sequence[int], writer: int) -> None:
    """Drop this writer's claims on the slots (a batch it could not fill); not in a segment
    that was dropped or shrank (``segments.py``): its claims go with it."""
    if segment.table is None or not segment.attached.intact():
        return
    claims, _ = segment.table.claims(slot_idxs)
    mine = [slot for slot, held_by in zip(slot_idxs, claims, strict=True) if held_by == writer]
    if mine:
        segment.table.set_claims(mine, 0)


def settle(segment: Segment, count: int) -> None:
    """``count`` claims of this writer here are resolved (committed or given up)."""
    segment.claimed = max(0, segment.claimed - count)
