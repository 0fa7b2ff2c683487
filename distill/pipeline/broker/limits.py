"""The broker's limits: every number a peer sends is capped where it is read.

``protocol.decode`` has already checked types and the protocol's own bounds (lengths,
integers within 0..2**63-1, map nesting). What is left here is what depends on the
broker's configuration: credit and batch sizes a worker claims, strides and slot
indices a student names, how much ``model_cfg`` a run may keep, and how many slots a
connection, a run or the broker may have queued. A value past a cap is either clamped
(a worker's credit: it only makes the worker get less work) or refused with an ERROR
that names the setting to raise (:func:`over_limit`).
"""

from __future__ import annotations

import time

import msgpack

from distill.pipeline import protocol
from distill.pipeline.broker.config import MAX_WORK_ITEMS, BrokerConfig
from distill.pipeline.protocol import ProtocolError
from distill.pipeline.slot import HEADER_BYTES

MAX_DIRECT_RUNS = 16
"""Runs of one worker's DIRECT fill report the broker reads (a worker serves a few)."""
MAX_DIRECT_PER_REPORT = 1 << 32
CFG_BYTES_PER_VALUE = 64
"""What one value of a ``model_cfg`` costs in memory beyond its packed bytes (an object)."""
ECHO_WINDOW_S = 1.0


def over_limit(what: str, limit: str) -> ProtocolError:
    """The refusal of input past one of the broker's limits, saying how to raise it."""
    return ProtocolError(f"{what}: over the broker's {limit}; raise it with pipeline.{limit}=N "
                         f"(Broker({limit}=N)) if this load is expected")


def worker_credit(config: BrokerConfig, credit: int) -> int:
    """A READY's credit, capped: a worker claiming more only gets less than it asked."""
    return min(credit, config.max_worker_credit)


def worker_batch(max_batch: int) -> int:
    """A READY's max_batch within 1 .. MAX_WORK_ITEMS (a WORK must fit in one message)."""
    return min(max(1, max_batch), MAX_WORK_ITEMS)


def check_request(config: BrokerConfig, stride: int, slots: list[list[int]]) -> None:
    """Refuse a REQUEST whose geometry no student can have (its size is split at the
    queue limits instead: what does not fit is named back, to be asked for again)."""
    if stride <= HEADER_BYTES:
        raise ProtocolError(f"REQUEST.stride {stride} leaves no room after the {HEADER_BYTES}-byte header")
    if stride > config.max_stride_bytes:
        raise over_limit(f"REQUEST.stride {stride}", "max_stride_bytes")
    top = config.max_slots_per_medium
    if any(slot_idx >= top for slot_idx, _ in slots):
        raise over_limit(f"REQUEST names a slot index >= {top}", "max_slots_per_medium")


def cfg_cost(config: BrokerConfig, model_cfg: dict | None) -> int:
    """What keeping ``model_cfg`` for a run costs (packed bytes plus an object per value),
    or a refusal when it is larger than one run may keep."""
    if model_cfg is None:
        return 0
    packed = len(msgpack.packb(model_cfg, use_bin_type=True))
    if packed > config.max_model_cfg_bytes:
        raise over_limit(f"SET_MODEL.model_cfg of {packed} bytes packed", "max_model_cfg_bytes")
    return packed + CFG_BYTES_PER_VALUE * _values(model_cfg)


def _values(value: dict | list) -> int:
    """Values in a nested map or list (bounded by ``protocol.MAX_CFG_NODES``: no recursion)."""
    count, stack = 0, [value]
    while stack:
        node = stack.pop()
        children = list(node.values()) if isinstance(node, dict) else node
        count += len(children)
        stack.extend(child for child in children if isinstance(child, dict | list))
    return count


def direct_counts(value: object) -> dict[str, tuple[int, int]]:
    """A worker's ``direct`` report, keeping only well-formed entries (run id -> two counts)."""
    if not isinstance(value, dict):
        return {}
    return {run_id: (counts[0], counts[1]) for run_id, counts in list(value.items())[:MAX_DIRECT_RUNS]
            if isinstance(run_id, str) and isinstance(counts, list) and len(counts) == 2
            and all(type(n) is int and 0 <= n <= protocol.MAX_INT for n in counts)}


def check_generation_room(run_id: str, generation: int, restore: int | None) -> None:
    """Refuse a SET_MODEL whose generation would not fit the wire's integers: the run's
    state stays as it was, instead of every later WORK and WELCOME failing to encode."""
    if max(generation, restore or 0) >= protocol.MAX_INT:
        raise ProtocolError(f"run {run_id}: generation {max(generation, restore or 0)} is at the "
                            "protocol's maximum (2**63-1); start a new run_id")


class EchoBudget:
    """How many refused slots the broker names back to one connection per second.

    A refused REQUEST is answered with its slots so that the student can ask for them
    again after a pause (a student pauses half a second, so it needs at most its own
    slots named per second). A peer that floods REQUESTs it never reads the answers to
    would otherwise have the broker queue a copy of every flood message for it; past
    the budget the ERROR goes without the slots.
    """

    def __init__(self, slots_per_window: int) -> None:
        self.slots_per_window = slots_per_window
        self._spent: dict[bytes, int] = {}
        self._window_start = time.monotonic()

    def take(self, identity: bytes, count: int) -> bool:
        now = time.monotonic()
        if now - self._window_start >= ECHO_WINDOW_S:
            self._spent.clear()
            self._window_start = now
        spent = self._spent.get(identity, 0) + count
        if spent > self.slots_per_window:
            return False
        self._spent[identity] = spent
        return True
