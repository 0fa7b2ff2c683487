"""A worker's batches: WORK and DIRECT messages claimed, filled, committed and answered.

The worker's loop (``loop.py``) takes messages off its sockets and hands each batch of
them here. Invariants to keep when editing:

- each item is checked against its segment's own header and its slot claimed before
  any byte of it is written (``segments.py``, ``claims.py``); the payload is written
  first and the header last, only over a claim that still stands (``commit.py``); no
  more than a segment's fair share of its slots is claimed at once, the rest of a
  batch is filled in further calls, before DONE;
- a ``finish`` callable returned by a ``batch_fn`` (copies still in flight) is called,
  and the batch committed, only after the NEXT waiting batch has started, or at once
  when none waits: a sample is never late by more than a batch;
- a fan-out WORK (``runs``/``copies``, ``protocol.py``): only *source* items are
  computed and copied into their copies' slots, each header with its own run's
  generation; a run stale here gets no header ("stale") while its sources are still
  computed for the others.

See docs/pipeline.md, sections The Python API and GPU paths.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Iterable

import zmq

from distill.pipeline import protocol
from distill.pipeline.liveness import FillProgress
from distill.pipeline.mediums.tcp import is_tcp_medium
from distill.pipeline.protocol import Command, Message, ProtocolError
from distill.pipeline.throttle import LogThrottle
from distill.pipeline.worker.commit import Committer
from distill.pipeline.worker.config import Deferred, SlotTarget
from distill.pipeline.worker.direct import DirectLane, Model, NoLane, why_not
from distill.pipeline.worker.fill import (
    Failures,
    Filler,
    Run,
    fail_runs,
    group_by_model,
    shared_sources,
    with_generations,
)
from distill.pipeline.worker.segments import Segments

log = logging.getLogger(__name__)

Send = Callable[[zmq.Socket, Command, dict], None]
"""How the batches reach the broker: the loop's patient send (it knows when to give up)."""


class Generations:
    """The newest generation this worker has seen of each run (MODEL broadcasts and WORK
    alike), and the model of the last one: what makes a WORK or a DIRECT stale."""

    def __init__(self) -> None:
        self.by_run: dict[str, int] = {}
        self.model_id: str | None = None
        self.last_run = protocol.DEFAULT_RUN

    def of(self, run_id: str) -> int:
        return self.by_run.get(run_id, 0)

    def note(self, run_id: str, generation: int, model_id: str) -> None:
        if generation >= self.of(run_id):
            self.by_run[run_id] = generation
            self.model_id = model_id
            self.last_run = run_id


class Batches:
    """Fills what the loop hands it and says DONE (or answers a DIRECT); holds the batch
    whose commit waits for the next one to start (see the module docstring)."""

    def __init__(self, peer_id: str, filler: Filler, committer: Committer, segments: Segments,
                 progress: FillProgress, generations: Generations, send: Send) -> None:
        self.peer_id = peer_id
        self._filler = filler
        self._committer = committer
        self._segments = segments
        self._progress = progress
        self._generations = generations
        self._send = send
        self.lane: DirectLane | NoLane = NoLane()
        """Where filled slots are announced and DIRECTs answered (the loop opens it)."""
        self._deferred: tuple[list[Message], Failures, Deferred] | None = None
        self._models: dict[str, Model] = {}
        """run -> (generation, model id, model cfg) of its last plain WORK: what a DIRECT may ask for."""
        self._shared_runs: set[str] = set()
        """Runs opted in to fan-out: always through the broker, which shares their samples."""
        self._refusals = LogThrottle(log)

    @property
    def pending(self) -> bool:
        """A batch is left to commit (it may still write to any mapped segment)."""
        return self._deferred is not None

    def direct_model(self, body: dict) -> Model | str:
        """The model to fill a DIRECT with, as the broker would, or why it cannot be."""
        run_id = body["run_id"]
        model = self._models.get(run_id)
        return why_not(body, model, run_id in self._shared_runs, self._generations.of(run_id)) or model

    # ------------------------------------------------------------------ plain WORK and DIRECT
    def process(self, works: list[Message], sock: zmq.Socket) -> None:
        shared = [[work] for work in works if work.body.get("runs") is not None]
        plain = [work for work in works if work.body.get("runs") is None]
        for group in shared:  # fan-out WORKs: filled and committed at once
            self.finish_deferred(sock)
            self._send_done(sock, group, self._fill_shared(group[0].body))
        for group in group_by_model(plain):
            self._fill_group(group, sock)
        if self._deferred is not None and not protocol.readable(sock) and not self.lane.waiting():
            self.finish_deferred(sock)  # no next batch to overlap with: finish now

    def finish_deferred(self, sock: zmq.Socket) -> None:
        """Commit the group whose copies were left in flight, and say DONE."""
        if self._deferred is None:
            return
        group, failed, deferred = self._deferred
        self._deferred = None
        deferred()
        self._send_done(sock, group, failed)

    def _fill_group(self, group: list[Message], sock: zmq.Socket) -> None:
        """Fill every slot of WORKs of one (run, generation, model), in as many batches as
        the students' fair shares take; say DONE (the last batch may be left to commit
        while the next one fills, see the module docstring)."""
        first = group[0].body
        run_id, generation, model_id = first["run_id"], first["generation"], first["model_id"]
        failed: Failures = {}
        if generation < self._generations.of(run_id):
            for work in group:
                failed[work.body["work_id"]] = dict.fromkeys(range(len(work.body["items"])), "stale")
            self.finish_deferred(sock)
            self._send_done(sock, group, failed)
            return
        self._generations.note(run_id, generation, model_id)
        if group[0].command is Command.WORK:
            self._models[run_id] = (generation, model_id, first.get("model_cfg"))
            (self._shared_runs.add if first.get("shared") else self._shared_runs.discard)(run_id)
        left = [(work.body, range(len(work.body["items"]))) for work in group]
        deferred = None
        while left:
            runs: list[Run] = []
            left = [(body, waiting) for body, idxs in left
                    if (waiting := self._filler.add_targets(body, generation, runs, failed, idxs))]
            targets = [target for run in runs for target in run.targets]
            if left and not targets:  # our own claims still pending commit fill the shares
                left = self._make_room(sock, left, failed)
                continue
            deferred = self._generate(model_id, first.get("model_cfg"), runs, failed)
            self.finish_deferred(sock)  # the previous batch's copies ran during this fill
            if deferred is not None and left:
                deferred()  # more of this group to fill: its claims must be settled first
                deferred = None
        if deferred is None:
            self._send_done(sock, group, failed)
        else:
            self._deferred = group, failed, deferred

    def _make_room(self, sock: zmq.Socket, left: list[tuple[dict, list[int]]],
                   failed: Failures) -> list[tuple[dict, list[int]]]:
        """Nothing more of a group can be claimed: commit the batch left in flight (its
        claims count against the shares); with none, this worker holds no claim at all,
        so counts that say otherwise are reset (once; then the rest fails)."""
        if self._deferred is not None:
            self.finish_deferred(sock)
            return left
        if self._segments.reset_claims():
            log.error("worker %s: claim counts were out of step with its batches; reset", self.peer_id)
            return left
        _fail_waiting(left, failed, "over the student's share of writers")
        return []

    def _generate(self, model_id: str, model_cfg: dict | None, runs: list[Run],
                  failed: Failures) -> Deferred | None:
        """Fill the runs' targets and commit them, or return the commit when copies are in flight."""
        self._filler.refuse_shrunk(runs, failed)  # (the sample function writes into the rest)
        targets = [target for run in runs for target in run.targets]
        if not targets:
            return None
        try:
            with self._progress.batch():
                lengths, finish = self._filler.generate(model_id, model_cfg, targets)
        except Exception as exc:  # a generator bug must not kill the worker
            log.exception("worker %s: generator failed for model %s", self.peer_id, model_id)
            self._committer.give_up(runs)
            fail_runs(runs, failed, f"generator failed: {exc!r}")
            return None
        if callable(finish):
            return lambda: self._finish_and_commit(finish, model_id, runs, lengths, failed)
        self._committer.commit_runs(runs, lengths, failed)
        return None

    def _finish_and_commit(self, finish: Callable[[], None], model_id: str, runs: list[Run],
                           lengths: list[int], failed: Failures) -> None:
        self._check_sizes(runs)  # a segment shrunk meanwhile: grown back for these copies, then refused
        try:
            with self._progress.batch():
                finish()
        except Exception as exc:  # a failed copy fails its slots, not the worker
            log.exception("worker %s: finishing a batch of model %s failed", self.peer_id, model_id)
            self._committer.give_up(runs)
            fail_runs(runs, failed, f"generator failed: {exc!r}")
            return
        self._committer.commit_runs(runs, lengths, failed)

    def _check_sizes(self, runs: list[Run]) -> None:
        """Before copies land in the runs' slots: a segment that shrank since it was mapped is
        grown back (so they cannot fault) and dropped (its slots fail at commit)."""
        for run in runs:
            if run.segment is not None:
                self._segments.check_size(run.segment)

    # ------------------------------------------------------------------ DONE and notices
    def _send_done(self, sock: zmq.Socket, group: list[Message], failed: Failures) -> None:
        for work in group:
            body = work.body
            failures = failed.get(body["work_id"], {})
            if work.command is Command.DIRECT:
                self.lane.answer(body, failures)
                continue
            done = {"peer_id": self.peer_id, "work_id": body["work_id"], "num_items": len(body["items"]),
                    "failed": [[idx, why] for idx, why in sorted(failures.items())]}
            notified = self._notify(body, failures) if self.lane.notifies else []
            if notified:
                done["notified"] = notified
            self._send(sock, Command.DONE, done)

    def _notify(self, body: dict, failures: dict[int, str]) -> list[str]:
        """Tell the students whose shared memory we filled, straight to their inboxes
        (``notices.py``), before DONE reaches the broker. Returns the segments every
        notice reached: the broker completes the others."""
        rows: dict[tuple[str, int], list[list]] = {}
        for idx, generation, (medium, slot_idx, _stride, request_id) in with_generations(body):
            if idx not in failures and medium in self._segments and not is_tcp_medium(medium):
                rows.setdefault((medium, generation), []).append([slot_idx, request_id, True])
        shared = body.get("runs") is not None or body.get("shared")
        reached, missed = set(), set()
        for (medium, generation), slots in rows.items():
            (reached if self.lane.notice(medium, generation, slots, bool(shared)) else missed).add(medium)
        return sorted(reached - missed)

    # ------------------------------------------------------------------ fan-out
    def _fill_shared(self, body: dict) -> Failures:
        """Fill a fan-out WORK: compute its sources once, copy them into their copies,
        commit the slots of runs whose generation is current. Returns failures."""
        work_id = body["work_id"]
        try:
            sources = shared_sources(body)
        except ProtocolError as exc:
            self._refusals.warning("worker %s: %s", self.peer_id, exc.reason)
            return {work_id: dict.fromkeys(range(len(body["items"])), exc.reason[:200])}
        failed: Failures = {}
        runs, live = self._shared_targets(body, failed)
        self._filler.refuse_shrunk(runs, failed)  # (the sample function writes into the rest)
        where = {idx: target for run in runs for idx, target in zip(run.idxs, run.targets, strict=True)}
        sources = rehome_sources(sources, where.keys(), [idx for run in live for idx in run.idxs])
        needed = sorted({sources.get(idx, idx) for run in live for idx in run.idxs} & where.keys())
        try:
            lengths = self._make(body["model_id"], body.get("model_cfg"), [where[i] for i in needed])
        except Exception as exc:  # a generator bug must not kill the worker
            log.exception("worker %s: generator failed for model %s", self.peer_id, body["model_id"])
            self._committer.give_up(runs)
            for run in live:
                failed.setdefault(work_id, {}).update(dict.fromkeys(run.idxs, f"generator failed: {exc!r}"[:200]))
            return failed
        made = dict(zip(needed, lengths, strict=True))
        self._check_sizes(runs)  # sources are copied out of these segments, copies into them
        live_runs = {id(run) for run in live}
        for run in runs:
            if id(run) in live_runs:
                self._commit_copies(run, sources, where, made, failed)
            else:
                self._committer.give_up([run])
        return failed

    def _shared_targets(self, body: dict, failed: Failures) -> tuple[list[Run], list[Run]]:
        """Targets of every group of a fan-out WORK, and the runs of those whose
        generation is current (the others' items fail as "stale")."""
        runs: list[Run] = []
        live: list[Run] = []
        start = 0
        for run_id, generation, count in body["runs"]:
            first = len(runs)
            self._filler.add_targets(body, generation, runs, failed, range(start, start + count), share=False)
            if generation < self._generations.of(run_id):
                failed.setdefault(body["work_id"], {}).update(dict.fromkeys(range(start, start + count), "stale"))
            else:
                self._generations.note(run_id, generation, body["model_id"])
                self._shared_runs.add(run_id)
                live.extend(runs[first:])
            start += count
        return runs, live

    def _make(self, model_id: str, model_cfg: dict | None, targets: list[SlotTarget]) -> list[int]:
        """Generate into ``targets``; the payload length of each (-1: did not fit)."""
        if not targets:
            return []
        with self._progress.batch():
            lengths, finish = self._filler.generate(model_id, model_cfg, targets)
            if callable(finish):  # copies in flight: the copies below read these payloads
                finish()
        return lengths

    def _commit_copies(self, run: Run, sources: dict[int, int], where: dict[int, SlotTarget],
                       made: dict[int, int], failed: Failures) -> None:
        """Copy each copy's source payload into its slot, then commit the run's slots."""
        keep, lengths, unmade = [], [], []
        for pos, idx in enumerate(run.idxs):
            source = sources.get(idx, idx)
            length = made.get(source)
            if length is None:  # its source's address was bad
                failed.setdefault(run.work_id, {})[idx] = "source sample not made"
                unmade.append(pos)
                continue
            if source != idx and length > 0:
                run.targets[pos].payload[:length] = where[source].payload[:length]
            keep.append(pos)
            lengths.append(length)
        if unmade:
            lost = Run(run.work_id, run.medium, run.stride, run.segment, None,
                       [run.idxs[p] for p in unmade], [run.slot_idxs[p] for p in unmade],
                       [run.targets[p] for p in unmade])
            self._committer.give_up([lost])
            run.keep(keep)
        self._committer.commit(run, lengths, failed)


def _fail_waiting(left: list[tuple[dict, list[int]]], failed: Failures, why: str) -> None:
    for body, idxs in left:
        failed.setdefault(body["work_id"], {}).update(dict.fromkeys(idxs, why))


def rehome_sources(sources: dict[int, int], writable: Container[int], wanted: Iterable[int]) -> dict[int, int]:
    """Copy item -> source item, where a copy whose source has no slot to be made in (its
    run's segment is gone: that student left, or its address was bad) is made in its own
    slot instead, and the other copies of that source are copied from it. Without this, a
    run that leaves fails every sample other runs were to copy from its slots, and they
    ask again for what the teacher could have made for them in the same batch."""
    rehomed: dict[int, int] = {}
    moved: dict[int, int] = {}
    for idx in wanted:
        source = sources.get(idx, idx)
        if source != idx and source not in writable:
            source = moved.setdefault(source, idx)
        if source != idx:
            rehomed[idx] = source
    return rehomed
