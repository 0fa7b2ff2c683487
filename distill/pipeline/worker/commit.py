"""Committing: a filled run's headers, written last, and only over standing claims.

The payload of every slot of a run is in place when this runs (the sample function
returned, and its ``finish`` if it had one). For shared memory the commit fields of
each header are written only where this writer's claim and the fill it was given
still stand (``claims.py``); a slot whose claim was lost is reported ``"stale"``, and
every claim of the run is settled (committed or given up). A staged run (network
medium) gets whole headers, claim and fill included (nobody else can write those
buffers), and goes out in one DATA message. A sample that did not fit its slot, or
whose size is not the one the student's segment declares, fails its slot; so does
every slot of a segment whose owner shrank it (``segments.py``): nothing is written there.
"""

from __future__ import annotations

import logging

from distill.pipeline.mediums.tcp import TcpSender
from distill.pipeline.slot import SlotHeader, payload_checksum, write_claim, write_header
from distill.pipeline.worker import claims
from distill.pipeline.worker.fill import Failures, Run
from distill.pipeline.worker.segments import Segments

log = logging.getLogger(__name__)


class Committer:
    """Writes the headers of filled runs (see module docstring)."""

    def __init__(self, writer: int, checksum: bool, sender: TcpSender, peer_id: str, segments: Segments) -> None:
        self.writer = writer
        self.segments = segments
        self.checksum = checksum
        self.sender = sender
        self.peer_id = peer_id
        self.samples_written = 0

    def commit_runs(self, runs: list[Run], lengths: list[int], failed: Failures) -> None:
        start = 0
        for run in runs:
            self.commit(run, lengths[start:start + len(run.targets)], failed)
            start += len(run.targets)

    def commit(self, run: Run, lengths: list[int], failed: Failures) -> None:
        """Commit a run's filled slots (their payloads are in place)."""
        if not run.targets:  # every item of the run had a bad address or was refused
            return
        claimed = len(run.targets)
        expected = run.segment.payload_bytes if run.segment is not None else 0
        fits = min(lengths) >= 0 and (not expected or min(lengths) == max(lengths) == expected)
        if not fits:  # (a batch_fn's samples all fit: the common case skips this)
            lengths = self._drop_misfits(run, lengths, expected, failed)
        if run.staged is not None:
            if run.targets:
                self._send_staged(run, lengths, failed)
            return
        try:
            if run.targets:
                self._write(run, lengths, failed)
        finally:
            claims.settle(run.segment, claimed)

    def _drop_misfits(self, run: Run, lengths: list[int], expected: int, failed: Failures) -> list[int]:
        """Fail the slots whose sample did not fit (or is not the student's size); give up
        their claims; keep the rest of the run. Returns the lengths of those kept."""
        bad = {pos: run.targets[pos].failure or _misfit(length, expected) for pos, length in enumerate(lengths)
               if length < 0 or (expected and length != expected)}
        for pos, why in bad.items():
            failed.setdefault(run.work_id, {})[run.idxs[pos]] = why
        if run.segment is not None:
            claims.give_up(run.segment, [run.slot_idxs[pos] for pos in bad], self.writer)
        keep = [pos for pos in range(len(lengths)) if pos not in bad]
        run.keep(keep)
        return [lengths[pos] for pos in keep]

    def give_up(self, runs: list[Run]) -> None:
        """Drop the claims of runs that will not be committed (their fill failed)."""
        for run in runs:
            if run.segment is not None and run.targets:
                claims.give_up(run.segment, run.slot_idxs, self.writer)
                claims.settle(run.segment, len(run.targets))

    def _write(self, run: Run, lengths: list[int], failed: Failures) -> None:
        segment, targets = run.segment, run.targets
        why = self.segments.check_size(segment)  # unmapped meanwhile (its owner is gone), or shrunk
        if why is not None:
            failed.setdefault(run.work_id, {}).update(dict.fromkeys(run.idxs, why[:200]))
            return
        reqs = [target.request_id for target in targets]
        standing = claims.still_claimed(segment, run.slot_idxs, reqs, self.writer)
        if not all(standing):  # the student asked for these slots again: not ours to commit
            for pos in [pos for pos, ok in enumerate(standing) if not ok]:
                failed.setdefault(run.work_id, {})[run.idxs[pos]] = claims.STALE
            run.keep([pos for pos, ok in enumerate(standing) if ok])
            lengths = [length for length, ok in zip(lengths, standing, strict=True) if ok]
            targets, reqs = run.targets, [target.request_id for target in run.targets]
            if not targets:
                return
        checksums = ([payload_checksum(target.payload[:length]) for target, length in zip(targets, lengths, strict=True)]
                     if self.checksum else None)
        segment.table.write(run.slot_idxs, targets[0].generation, reqs, lengths, checksums, self.writer)
        self.samples_written += len(run.slot_idxs)

    def _send_staged(self, run: Run, lengths: list[int], failed: Failures) -> None:
        """Commit staged slots (header last, as in shared memory) and send them."""
        for buf, target, length in zip(run.staged, run.targets, lengths, strict=True):
            checksum = payload_checksum(target.payload[:length]) if self.checksum else None
            write_claim(buf, self.writer, target.request_id)
            write_header(buf, SlotHeader(target.generation, target.request_id, length, checksum, self.writer))
        problem = self.sender.send(run.medium, run.targets[0].generation, run.stride,
                                   [[slot_idx, t.request_id] for slot_idx, t in zip(run.slot_idxs, run.targets,
                                                                                    strict=True)],
                                   run.staged)
        if problem is not None:
            log.warning("worker %s: %s", self.peer_id, problem)
            failed.setdefault(run.work_id, {}).update(dict.fromkeys(run.idxs, problem[:200]))
            return
        self.samples_written += len(run.slot_idxs)


def _misfit(length: int, expected: int) -> str:
    if length < 0:
        return "sample larger than the slot"
    return f"sample of {length} bytes, the student's slots hold {expected}"
