"""Filling: WORK items -> claimed slot targets -> the sample function.

One WORK (or DIRECT, see ``direct.py``) names slots as ``[medium, slot_idx, stride,
request_id]``. Consecutive items of one medium and stride form a :class:`Run`; each
item's address is checked against its segment's own header (``segments.py``) and its
slot claimed (``claims.py``) before the sample function sees it. A network medium the
worker cannot map gets a fresh staging buffer per slot instead (sent by
``commit.py``). Then the sample function runs once per batch:

- ``generator_fn(model_id, model_cfg)`` (per sample): returned bytes are copied into
  the slot (a large ``BatchConfig.encode`` already wrote into it, ``encode_sink.py``);
  returned tensors by name are checked against ``batch_config`` and copied straight
  into the slot's views (``BatchConfig.copy_into``). A sample that does not fit, or
  tensors that are not the config's, fail that slot with the reason; the worker goes on;
- ``batch_fn(model_id, model_cfg, targets)`` (zero-copy): writes into the targets'
  views; it may return a ``finish`` callable, which the worker calls before it commits
  (``batches.py``).

What each path costs: docs/pipeline.md, section The Python API.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from distill.pipeline import encode_sink
from distill.pipeline.mediums.tcp import TcpSender, is_tcp_medium, medium_label
from distill.pipeline.protocol import Message, ProtocolError
from distill.pipeline.slot import HEADER_BYTES
from distill.pipeline.throttle import LogThrottle
from distill.pipeline.worker import claims
from distill.pipeline.worker.config import BatchFn, GeneratorFn, SlotTarget, WorkerConfig
from distill.pipeline.worker.segments import Segment, Segments, SlotViews

log = logging.getLogger(__name__)

Failures = dict[int, dict[int, str]]
"""work_id -> item index -> why that item was not filled."""


@dataclass
class Run:
    """Consecutive items of one WORK that go to one medium, cut with one stride."""

    work_id: int
    medium: str
    stride: int
    segment: Segment | None = None
    """The mapped segment (None: staged for the network medium, or a bad address)."""
    error: str | None = None
    """Why none of its items can be written (a segment that cannot be mapped)."""
    idxs: list[int] = field(default_factory=list)
    """Positions of the items in the WORK (what DONE.failed refers to)."""
    slot_idxs: list[int] = field(default_factory=list)
    targets: list[SlotTarget] = field(default_factory=list)
    staged: list[memoryview] | None = None
    """Network medium the worker cannot map: the whole staged slot of each target."""

    def keep(self, positions: list[int]) -> None:
        """Keep only the items at ``positions`` (the rest failed or wait)."""
        self.idxs = [self.idxs[p] for p in positions]
        self.slot_idxs = [self.slot_idxs[p] for p in positions]
        self.targets = [self.targets[p] for p in positions]
        if self.staged is not None:
            self.staged = [self.staged[p] for p in positions]


class Filler:
    """Turns WORK items into claimed targets and runs the sample function over them."""

    def __init__(self, config: WorkerConfig, generator_fn: GeneratorFn | None, batch_fn: BatchFn | None,
                 segments: Segments, sender: TcpSender, writer: int, peer_id: str) -> None:
        self.config = config
        self.slot_size = config.payload_bytes
        self.generator_fn = generator_fn
        self.batch_fn = batch_fn
        self.segments = segments
        self.sender = sender
        self.writer = writer
        self.peer_id = peer_id
        self.samples_computed = 0
        """Samples the generator made (fewer than the slots written under fan-out)."""
        self._refusals = LogThrottle(log)

    # ------------------------------------------------------------------ targets
    def add_targets(self, body: dict, generation: int, runs: list[Run], failed: Failures,
                    idxs: Iterable[int], *, share: bool = True) -> list[int]:
        """A claimed target for each of the items ``idxs`` of one WORK, grouped in runs
        (appended to ``runs``); bad addresses and refused claims fail. Returns the items
        left for a later batch by the owners' fair share (``share``: apply it)."""
        work_id, items = body["work_id"], body["items"]
        waiting: list[int] = []
        run: Run | None = None
        cached: dict = {}
        for idx in idxs:
            medium, slot_idx, stride, request_id = items[idx]
            if run is None or medium != run.medium or stride != run.stride:
                if run is not None:
                    waiting += self._claim(run, failed, share)
                run = self._new_run(work_id, medium, stride)
                runs.append(run)
                cached = run.segment.slots if run.segment is not None and stride == run.segment.stride else {}
            if run.error is not None:
                failed.setdefault(work_id, {})[idx] = run.error
                continue
            views = cached.get(slot_idx)  # the slot's views, checked and made once (segments.py)
            if views is None:
                try:
                    views = self._views(run, slot_idx, stride)
                except (OSError, ValueError, IndexError) as exc:
                    self._refuse_address(work_id, idx, slot_idx, medium, exc, failed)
                    continue
            payload, tensors = views
            run.idxs.append(idx)
            run.slot_idxs.append(slot_idx)
            run.targets.append(SlotTarget(request_id, generation, payload,
                                          None if tensors is None else dict(tensors)))
        if run is not None:
            waiting += self._claim(run, failed, share)
        return waiting

    def _new_run(self, work_id: int, medium: str, stride: int) -> Run:
        run = Run(work_id, medium, stride)
        try:
            if is_tcp_medium(medium) and self.sender.is_remote(medium, self.config.local_shm):
                run.staged = []
            else:
                run.segment = self.segments.fresh(medium)
        except FileNotFoundError as exc:  # unlinked: its student left with requests still queued here
            run.error = f"bad address: {exc}"[:200]
            log.debug("worker %s: %s is gone (its student left): %s", self.peer_id, _label(medium), exc)
        except (OSError, ValueError) as exc:
            run.error = f"bad address: {exc}"[:200]
            self._refusals.warning("worker %s: cannot write into %s: %s", self.peer_id, _label(medium), exc)
        return run

    def _views(self, run: Run, slot_idx: int, stride: int) -> SlotViews:
        if stride < HEADER_BYTES + self.slot_size:
            raise ValueError(f"stride {stride} < header + slot_size {HEADER_BYTES + self.slot_size}")
        if run.segment is not None:
            return self.segments.slot(run.segment, slot_idx, stride)
        buf = self.sender.stage(stride)  # a fresh staging buffer for the network medium
        run.staged.append(buf)
        payload = buf[HEADER_BYTES:HEADER_BYTES + self.slot_size]
        return payload, self._decode(payload)

    def _decode(self, payload: memoryview):
        config = self.config.batch_config
        return config.decode(payload) if config is not None else None

    def _claim(self, run: Run, failed: Failures, share: bool) -> list[int]:
        """Claim the run's slots; returns the items over the fair share (left for later)."""
        if run.segment is None or not run.targets:
            return []
        limit = run.segment.room() if share else None
        taken, refused, later = claims.claim(run.segment, run.slot_idxs, [t.request_id for t in run.targets],
                                             self.writer, limit)
        for pos in refused:
            failed.setdefault(run.work_id, {})[run.idxs[pos]] = claims.STALE
        waiting = [run.idxs[pos] for pos in later]
        if len(taken) < len(run.targets):
            run.keep(taken)
        return waiting

    def _refuse_address(self, work_id: int, idx: int, slot_idx: int, medium: str, exc: Exception,
                        failed: Failures) -> None:
        self._refusals.warning("worker %s: cannot write slot %d of %s: %s", self.peer_id, slot_idx,
                               _label(medium), exc)
        failed.setdefault(work_id, {})[idx] = f"bad address: {exc}"[:200]

    def refuse_shrunk(self, runs: list[Run], failed: Failures) -> None:
        """Take out of the batch the runs whose segment shrank since it was mapped (their
        items fail with the reason, ``Segments.check_size``): nothing more is written there."""
        for run in runs:
            if run.segment is None or not run.targets:
                continue
            why = self.segments.check_size(run.segment)
            if why is not None:
                failed.setdefault(run.work_id, {}).update(dict.fromkeys(run.idxs, why[:200]))
                claims.settle(run.segment, len(run.targets))
                run.keep([])

    # ------------------------------------------------------------------ samples
    def generate(self, model_id: str, model_cfg: dict | None,
                 targets: list[SlotTarget]) -> tuple[list[int], object]:
        """Run the sample function over ``targets``: the payload length of each (-1: did
        not fit), and what ``batch_fn`` returned (a ``finish`` callable, or None)."""
        self.samples_computed += len(targets)
        if self.batch_fn is not None:
            finish = self.batch_fn(model_id, model_cfg, targets)
            return [self.slot_size] * len(targets), finish
        return [self._generate_one(model_id, model_cfg, t) for t in targets], None

    def _generate_one(self, model_id: str, model_cfg: dict | None, target: SlotTarget) -> int:
        data = None
        encode_sink.open_slot(target.payload)  # a large BatchConfig.encode lands in the slot itself
        try:
            data = self.generator_fn(model_id, model_cfg)
        finally:
            in_slot = encode_sink.close_slot(data)
        if in_slot:  # the sample is in the slot already: nothing to copy
            return in_slot
        if isinstance(data, Mapping):
            return self._write_tensors(data, target)
        if isinstance(data, memoryview) and _released(data):
            target.failure = KEPT_VIEW
            self._refusals.warning("worker %s: %s", self.peer_id, KEPT_VIEW)
            return -1
        if len(data) > len(target.payload):
            log.error("generator returned %d bytes; slot_size is %d", len(data), len(target.payload))
            return -1
        target.payload[:len(data)] = data
        return len(data)

    def _write_tensors(self, tensors: Mapping, target: SlotTarget) -> int:
        """A sample returned as tensors by name: straight into the slot's views, or the
        slot fails with why (logged, throttled: one bad generator is one line, not a flood)."""
        config = self.config.batch_config
        if config is None:
            target.failure = NO_LAYOUT
        else:
            try:
                config.copy_into(target.tensors, tensors)
                return self.slot_size
            except (TypeError, ValueError) as exc:
                target.failure = f"generator_fn returned bad tensors: {exc}"[:200]
        self._refusals.warning("worker %s: %s", self.peer_id, target.failure)
        return -1


NO_LAYOUT = ("generator_fn returned tensors by name, but the Worker has no batch_config: pass "
             "Worker(batch_config=...) (the students' BatchConfig) so it knows where each tensor goes")


KEPT_VIEW = ("generator_fn returned what BatchConfig.encode gave it in an earlier call: inside a worker, "
             "encode writes a large sample straight into the slot being filled and its result is valid only "
             "until generator_fn returns; keep bytes(data) instead")


def _released(view: memoryview) -> bool:
    """Whether ``view`` was released (an encode result kept past its call)."""
    try:
        len(view)
    except ValueError:
        return True
    return False


def _label(medium: str) -> str:
    return medium_label(medium)[:80]


def fail_runs(runs: list[Run], failed: Failures, why: str) -> None:
    for run in runs:
        failed.setdefault(run.work_id, {}).update(dict.fromkeys(run.idxs, why[:200]))


def group_by_model(works: list[Message]) -> list[list[Message]]:
    groups: dict[tuple[str, int, str], list[Message]] = {}
    for work in works:
        b = work.body
        groups.setdefault((b["run_id"], b["generation"], b["model_id"]), []).append(work)
    return list(groups.values())


def with_generations(body: dict) -> Iterator[tuple[int, int, list]]:
    """(index, generation, item) for every item of a WORK (a fan-out WORK's groups
    each have their own generation)."""
    items = body["items"]
    if body.get("runs") is None:
        generation = body["generation"]
        for idx, item in enumerate(items):
            yield idx, generation, item
        return
    start = 0
    for _run_id, generation, count in body["runs"]:
        for idx in range(start, min(start + count, len(items))):
            yield idx, generation, items[idx]
        start += count


def shared_sources(body: dict) -> dict[int, int]:
    """Copy item -> source item of a fan-out WORK, checked against its item count."""
    num_items = len(body["items"])
    if sum(count for _, _, count in body["runs"]) != num_items:
        raise ProtocolError(f"WORK.runs covers {sum(c for _, _, c in body['runs'])} items, "
                            f"WORK.items has {num_items}")
    sources = dict(body.get("copies") or [])
    for idx, source in sources.items():
        if not (0 <= idx < num_items and 0 <= source < num_items) or source == idx or source in sources:
            raise ProtocolError(f"WORK.copies: item {idx} cannot copy item {source}")
    return sources
