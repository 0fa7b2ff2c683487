"""The wire protocol: every command and message schema of the pipeline, in one place.

This is the only module that knows about frames and msgpack. Everything that
crosses a socket is built by :func:`encode` and checked by :func:`decode`, which
raises :class:`ProtocolError` (never ``AssertionError``) so that a peer sending
garbage is logged and answered, and the receiver keeps serving. A change a peer of
the previous version would refuse or misread bumps :data:`PROTOCOL_VERSION`.

Frames of one message (after the ROUTER identity frame, when there is one)::

    +----------------+-----------+------------------+
    | PROTOCOL_TAG   | command   | msgpack(body)    |
    | b"DST" + ver   | b"REQUEST"| dict, see SCHEMA |
    +----------------+-----------+------------------+

Sockets and who sends what (S = student, W = worker, B = broker, L = leader):

    Frontend ROUTER  S->B  HELLO, REQUEST, HEARTBEAT, STATS, BYE
                     B->S  WELCOME, COMPLETE, DISCARDED, QUARANTINE, RELEASE, ERROR,
                           STATS_REPLY
    Backend  ROUTER  W->B  READY, DONE, HEARTBEAT, BYE
                     B->W  WORK, ERROR, RECONNECT
    Control  ROUTER  L->B  SET_MODEL, STOP, STATS
                     B->L  MODEL_SET, STATS_REPLY, ERROR
    ControlPub PUB   B->*  MODEL, STOP    (topic frame = run id, or b"" for all)
    Data     PULL    W->S  DATA + one frame per slot   (network medium only, see
                           ``mediums/tcp.py``; the broker never sees it; a peer without
                           the medium's key completes no handshake)
    Inbox    unix    W->S  COMPLETE, DECLINED: one datagram each (shared memory on
             dgram               the worker's machine, see ``notices.py``; DONE.notified
                                 names the segments whose filled slots need no COMPLETE)
    Lane     unix    S->W  DIRECT, one datagram       (a worker's request inbox, named in
             dgram               COMPLETE.lane: a student asks the worker that filled a
                                 slot to fill it again, past the broker; ``notices.py``)

Slot items travel as compact lists rather than dicts so that one REQUEST, WORK or
DONE can carry hundreds of slots cheaply:

    REQUEST.slots  [[slot_idx, request_id], ...]           (one medium per REQUEST)
    WORK.items     [[medium, slot_idx, stride, request_id], ...]
    DONE.failed    [[item_idx, reason], ...]               (items not written)
    DONE.notified  [medium, ...]                           (told directly, see notices.py)
    COMPLETE.slots [[slot_idx, request_id, ok], ...]
    DIRECT.slots   [[slot_idx, request_id], ...]           (as REQUEST.slots)
    DECLINED.slots [[slot_idx, request_id], ...]           (DIRECT slots not taken)
    WORK.runs      [[run_id, generation, num_items], ...]  (fan-out only, see below)
    WORK.copies    [[item_idx, source_item_idx], ...]      (fan-out only)

Heartbeats carry what the broker cannot see itself:

    worker HEARTBEAT, READY  direct {run_id: [filled, failed]} (DIRECT fills so far),
                             backlog (DIRECT slots held); HEARTBEAT only: batches
                             (batches finished, ``broker/deadline.py``)
    broker's answers         interval_ms (peers beat at least this often); to
                             students: workers (live workers, ``custody.direct_share``)

A fan-out WORK (``SET_MODEL.share_model``) cuts ``items`` into consecutive groups,
one per ``runs`` entry, each with its own run and generation (the top-level
``run_id``/``generation`` are the first group's); ``copies`` names the items that get
another item's sample (its *source*, never itself a copy), each header still carrying
its own request id and generation. A WORK without ``runs`` is the plain one-run WORK;
one of an opted-in run says ``shared``, and its worker offers no direct requests for it.

What the messages mean: docs/pipeline.md (sections Flow, Notices, Direct requests,
Faults, Limits); leader secrets, epochs and bounded replies: docs/security.md
(sections Leaders, roles and numbers; Bounded replies).
"""

from __future__ import annotations

import enum
import gc
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

PROTOCOL_VERSION = 10
"""Bumped when a peer of the previous version would refuse or misread a message
(2: DONE.notified; a version-1 broker would refuse such a DONE and strand its work.
3: COMPLETE.lane and the DIRECT/DECLINED datagrams; a version-2 student would drop a
notice naming a lane, and its slots, already done at the broker, would never complete.
4: QUARANTINE.direct; a version-3 student would refuse it and keep waiting on the slots
it asked of a silent worker directly.
5: slot headers of version 2 (writer claims, ``slot.py``), segment headers, keyed data
sockets (``mediums/tcp.py``) and SET_MODEL.min_generation; a version-4 worker's
headers would be refused by every student, and a version-4 broker would refuse the
leader's switches.
6: HEARTBEAT.backlog and .workers, READY.backlog (the load that follows the workers,
``custody.direct_share``); a version-5 student would refuse every heartbeat answer and
take the broker for silent, a version-5 broker every worker's READY).
7: HEARTBEAT.batches (a worker's finished batches: one stuck in its batch function while
it holds DIRECT work is given up on, ``broker/deadline.py``); a version-6 broker would
refuse every such heartbeat and purge the worker as silent).
8: SET_MODEL.leader_secret, STOP.leader_secret and MODEL_SET.leader_epoch (a run's leader is
whoever holds its secret, ``broker/control.py``); a version-7 broker would refuse every
switch, a version-7 leader would be refused by every broker.
9: WELCOME.model_digest, and WELCOME.model_cfg only the first time a connection is
welcomed to a model; a version-8 student would refuse every WELCOME).
10: WORK.model_digest, and WORK.model_cfg only in a worker's first WORK of a model;
DONE.unknown_cfg (a worker that no longer has the config asks for it again). A version-9
worker would take a WORK without model_cfg for a model without one, and fill it wrong."""
PROTOCOL_TAG = b"DST" + bytes([PROTOCOL_VERSION])

DEFAULT_RUN = "default"
"""The run of a peer that names none: the broker, students, workers and the application
agree on it here, the contract they all import."""

# Bounds on untrusted input. A message larger than this is dropped by ZeroMQ itself
# (socket option MAXMSGSIZE) before we ever see it.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_ITEMS_PER_MESSAGE = 65536
MAX_STRING_CHARS = 255
MAX_INT = 2**63 - 1
TAKE_OVER_EPOCH = 0
"""SET_MODEL.leader_epoch of a new leader process the broker has told no epoch yet: it
takes over its run at the run's next epoch (``broker/control.py``)."""
# What unpacking a body may cost. msgpack builds every object of a body before we can
# look at it, and the smallest objects cost the most per byte (an empty map: 1 byte on
# the wire, 64 in memory), so a 4 MiB body of empty maps would cost ~290 MiB and 0.3 s
# to refuse. Bodies are therefore capped per command (below), lengths by msgpack's
# ``max_*_len``, and a large body stops unpacking at its MAX_CONTAINERS-th list or map.
SMALL_BODY_BYTES = 64 * 1024
"""Body of a command that carries no slot list (HELLO, READY, HEARTBEAT, BYE, STATS, ...)."""
MAX_CFG_BYTES = 64 * 1024
"""A ``model_cfg`` (and any other map field) as packed: what a run's model may weigh."""
MAX_CFG_DEPTH = 32
"""Nesting of a map field: deep enough for any config, shallow enough that comparing or
packing two of them can never hit the interpreter's recursion limit."""
MAX_CFG_NODES = 16_384
"""Values (keys, items, leaves) in one ``model_cfg``."""
MAX_CONTAINERS = MAX_ITEMS_PER_MESSAGE + MAX_CFG_NODES
"""Lists and maps in one body: one per slot item, plus a model_cfg's."""
MAX_MAPS = 2 * MAX_CFG_NODES
"""Maps in one body (the dearest object per wire byte): a body, a model_cfg, STATS per run."""
UNCOUNTED_BODY_BYTES = 4096
"""Bodies up to this size are unpacked without counting (they cannot hold more than
this many objects, a few hundred KiB at worst): the hot path stays as fast as before."""
STATS_TOP_RUNS = 32
"""Runs named in a STATS_REPLY's ``per_run`` (the busiest ones, plus the one STATS.run_id
names): the answer weighs the same for 1 run or 1,000."""


class Command(bytes, enum.Enum):
    """Wire commands. Values are the bytes of the command frame."""

    HELLO = b"HELLO"
    WELCOME = b"WELCOME"
    REQUEST = b"REQUEST"
    READY = b"READY"
    WORK = b"WORK"
    DONE = b"DONE"
    COMPLETE = b"COMPLETE"
    DISCARDED = b"DISCARDED"
    QUARANTINE = b"QUARANTINE"
    RELEASE = b"RELEASE"
    SET_MODEL = b"SET_MODEL"
    MODEL_SET = b"MODEL_SET"
    MODEL = b"MODEL"
    STOP = b"STOP"
    STATS = b"STATS"
    STATS_REPLY = b"STATS_REPLY"
    HEARTBEAT = b"HEARTBEAT"
    RECONNECT = b"RECONNECT"
    BYE = b"BYE"
    ERROR = b"ERROR"
    DATA = b"DATA"
    DIRECT = b"DIRECT"
    DECLINED = b"DECLINED"


class ProtocolError(ValueError):
    """A message that does not follow this protocol. ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Message:
    """A decoded, validated message."""

    command: Command
    body: dict[str, Any]


# --------------------------------------------------------------------------- schema
# Each field: name -> kind. Kinds: "str", "int" (0..MAX_INT), "bool", "dict" (a msgpack
# map nested at most MAX_CFG_DEPTH deep, of at most MAX_CFG_NODES values: a model_cfg),
# "map" (as "dict", of any number of values: the broker's statistics), "names" (a list of "str"),
# or a list kind ("slots", "items", "failed", "done_slots") checked element-wise below.
# A trailing "?" marks an optional field.

SCHEMA: dict[Command, dict[str, str]] = {
    Command.HELLO: {"run_id": "str", "peer_id": "str", "rank": "int?"},
    Command.WELCOME: {"run_id": "str", "generation": "int", "model_id": "str?", "model_cfg": "dict?",
                      "model_digest": "str?",
                      "heartbeat_interval_ms": "int"},
    Command.REQUEST: {"run_id": "str", "peer_id": "str", "generation": "int", "medium": "str",
                      "stride": "int", "slots": "slots"},
    Command.READY: {"peer_id": "str", "credit": "int", "max_batch": "int", "process": "str?",
                    "direct": "dict?", "backlog": "int?"},
    Command.WORK: {"work_id": "int", "run_id": "str", "generation": "int", "model_id": "str",
                   "model_cfg": "dict?", "model_digest": "str?", "items": "items", "runs": "runs?",
                   "copies": "copies?", "shared": "bool?"},
    Command.DONE: {"peer_id": "str", "work_id": "int", "num_items": "int", "failed": "failed",
                   "notified": "names?", "unknown_cfg": "bool?"},
    Command.COMPLETE: {"generation": "int", "slots": "done_slots", "lane": "str?", "process": "str?"},
    Command.DISCARDED: {"generation": "int", "slots": "slots"},
    Command.QUARANTINE: {"slots": "slots", "process": "str?", "direct": "bool?"},
    Command.RELEASE: {"slots": "slots"},
    Command.SET_MODEL: {"run_id": "str", "model_id": "str", "model_cfg": "dict?",
                        "restore_generation": "int?", "min_generation": "int?", "leader_epoch": "int",
                        "peer_id": "str", "share_model": "bool?", "leader_secret": "str?"},
    Command.MODEL_SET: {"run_id": "str", "generation": "int", "model_id": "str", "leader_epoch": "int?"},
    Command.MODEL: {"run_id": "str", "generation": "int", "model_id": "str", "model_cfg": "dict?"},
    Command.STOP: {"run_id": "str?", "leader_secret": "str?"},
    Command.STATS: {"run_id": "str?"},
    Command.STATS_REPLY: {"stats": "map"},
    Command.HEARTBEAT: {"peer_id": "str", "role": "str", "direct": "dict?", "interval_ms": "int?",
                        "backlog": "int?", "workers": "int?", "batches": "int?"},
    Command.RECONNECT: {},
    Command.BYE: {"peer_id": "str"},
    Command.ERROR: {"reason": "str", "command": "str?", "slots": "slots?"},
    Command.DATA: {"generation": "int", "stride": "int", "slots": "slots"},
    Command.DIRECT: {"run_id": "str", "peer_id": "str", "generation": "int", "medium": "str",
                     "stride": "int", "slots": "slots"},
    Command.DECLINED: {"generation": "int", "slots": "slots", "reason": "str"},
}


_LIST_COMMANDS = frozenset({Command.REQUEST, Command.WORK, Command.DONE, Command.COMPLETE, Command.DISCARDED,
                            Command.QUARANTINE, Command.RELEASE, Command.ERROR, Command.DATA, Command.DIRECT,
                            Command.DECLINED, Command.STATS_REPLY})
_CFG_COMMANDS = frozenset({Command.WELCOME, Command.SET_MODEL, Command.MODEL})
MAX_BODY_BYTES: dict[Command, int] = {
    command: MAX_MESSAGE_BYTES if command in _LIST_COMMANDS
    else SMALL_BODY_BYTES + MAX_CFG_BYTES if command in _CFG_COMMANDS else SMALL_BODY_BYTES
    for command in Command
}
"""Largest body :func:`decode` unpacks, per command (checked before unpacking)."""


def encode(command: Command, body: dict[str, Any] | None = None) -> list[bytes]:
    """Frames for ``command`` with ``body``, validated as ``decode`` would, except the
    items inside slot lists: we built those from validated input, and the receiver
    checks them anyway (checking hundreds of them twice would double the cost)."""
    body = {} if body is None else body
    _validate(command, body, check_items=False)
    return [PROTOCOL_TAG, command.value, msgpack.packb(body, use_bin_type=True)]


def cfg_digest(model_cfg: dict) -> str:
    """What names a ``model_cfg`` in WELCOME.model_digest: a hash of its packed bytes."""
    return hashlib.blake2b(msgpack.packb(model_cfg, use_bin_type=True), digest_size=16).hexdigest()


def decode(frames: list[bytes]) -> Message:
    """Parse and validate the frames of one message (identity frame already removed)."""
    if len(frames) != 3:
        raise ProtocolError(f"expected 3 frames, got {len(frames)}")
    tag, raw_command, raw_body = frames
    if tag != PROTOCOL_TAG:
        raise ProtocolError(f"bad protocol tag {bytes(tag[:8])!r} (want {PROTOCOL_TAG!r})")
    command = _COMMANDS.get(bytes(raw_command))
    if command is None:
        raise ProtocolError(f"unknown command {bytes(raw_command[:32])!r}")
    if len(raw_body) > MAX_BODY_BYTES[command]:
        raise ProtocolError(f"{command.name}: a body of {len(raw_body)} bytes, over the protocol's "
                            f"{MAX_BODY_BYTES[command]} for this command")
    try:
        body = _unpack(raw_body)
    except _TooManyObjects:
        raise ProtocolError(f"{command.name}: body holds more than {MAX_CONTAINERS} lists and maps, or more "
                            f"than {MAX_MAPS} maps") from None
    except Exception as exc:  # msgpack raises many types on garbage (and on its max_*_len)
        raise ProtocolError(f"{command.name}: body is not msgpack within the protocol's bounds "
                            f"({type(exc).__name__})") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"{command.name}: body must be a map, got {type(body).__name__}")
    _validate(command, body)
    return Message(command, body)


class _TooManyObjects(Exception):
    """Raised from msgpack's hooks to stop unpacking a body (see MAX_CONTAINERS)."""


def _unpack(raw: bytes) -> Any:
    """msgpack of one body, within the bounds above (see MAX_CONTAINERS).

    A large body is unpacked with the cyclic garbage collector paused: the tens of
    thousands of lists a REQUEST of many slots makes would otherwise set off collections
    of the whole heap (14 ms instead of 1 for 8,192 slots in a process that imported torch).
    """
    if len(raw) <= UNCOUNTED_BODY_BYTES:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True)
    left = [MAX_CONTAINERS, MAX_MAPS]

    def count_list(obj: list) -> list:
        left[0] -= 1
        if left[0] < 0:
            raise _TooManyObjects
        return obj

    def count_map(obj: dict) -> dict:
        left[0] -= 1
        left[1] -= 1
        if left[0] < 0 or left[1] < 0:
            raise _TooManyObjects
        return obj

    collecting = gc.isenabled()
    gc.disable()
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, list_hook=count_list, object_hook=count_map,
                               max_str_len=MAX_CFG_BYTES, max_bin_len=MAX_CFG_BYTES, max_ext_len=0,
                               max_array_len=MAX_ITEMS_PER_MESSAGE, max_map_len=MAX_ITEMS_PER_MESSAGE)
    finally:
        if collecting:
            gc.enable()


def nested_within(value: Any, max_depth: int, max_nodes: int) -> bool:
    """Whether a map or list nests at most ``max_depth`` deep and holds at most
    ``max_nodes`` values (keys count), found without recursion."""
    stack = [(value, 1)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            return False
        children = node.values() if type(node) is dict else node
        nodes += len(node) * (2 if type(node) is dict else 1)
        if nodes > max_nodes:
            return False
        stack.extend((child, depth + 1) for child in children if type(child) in (dict, list))
    return True


def _validate(command: Command, body: dict[str, Any], *, check_items: bool = True) -> None:
    schema = SCHEMA[command]
    for key in body:
        if key not in schema:
            raise ProtocolError(f"{command.name}: unknown field {str(key)[:40]!r}")
    for key, kind, optional, quick_check in _FIELDS[command]:
        value = body.get(key)
        if value is None:
            if optional:
                continue
            raise ProtocolError(f"{command.name}: missing field {key!r}")
        if kind in _LIST_SHAPES and not check_items:
            if type(value) is not list or len(value) > MAX_ITEMS_PER_MESSAGE:
                raise ProtocolError(f"{command.name}.{key} must be a list of at most "
                                    f"{MAX_ITEMS_PER_MESSAGE} items")
        elif not quick_check(value):  # the full check says what is wrong (or accepts)
            _check_value(command, key, kind, value)


def _check_value(command: Command, key: str, kind: str, value: Any) -> None:
    where = f"{command.name}.{key}"
    if kind == "str":
        _check_str(where, value)
    elif kind == "int":
        _check_int(where, value)
    elif kind in ("dict", "map"):
        if not isinstance(value, dict):
            raise ProtocolError(f"{where} must be a map")
        nodes = MAX_CFG_NODES if kind == "dict" else MAX_CONTAINERS
        if not nested_within(value, MAX_CFG_DEPTH, nodes):
            raise ProtocolError(f"{where} nests deeper than {MAX_CFG_DEPTH} levels or holds more than "
                                f"{nodes} values")
    elif kind == "bool":
        if not isinstance(value, bool):
            raise ProtocolError(f"{where} must be true or false")
    elif kind == "names":
        if not _QUICK_CHECKS["names"](value):
            raise ProtocolError(f"{where} must be a list of at most {MAX_ITEMS_PER_MESSAGE} strings "
                                f"of at most {MAX_STRING_CHARS} chars")
    elif kind in _LIST_SHAPES:
        _check_list(where, value, _LIST_SHAPES[kind])
    else:  # pragma: no cover - schema typo
        raise AssertionError(f"unknown schema kind {kind}")


def _check_str(where: str, value: Any) -> None:
    if not isinstance(value, str) or len(value) > MAX_STRING_CHARS:
        raise ProtocolError(f"{where} must be a string of at most {MAX_STRING_CHARS} chars")


def _check_int(where: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_INT:
        raise ProtocolError(f"{where} must be an integer in [0, 2**63)")


# Element shapes of the list fields: a tuple of element kinds.
_LIST_SHAPES: dict[str, tuple[str, ...]] = {
    "slots": ("int", "int"),
    "items": ("str", "int", "int", "int"),
    "failed": ("int", "str"),
    "done_slots": ("int", "int", "bool"),
    "runs": ("str", "int", "int"),
    "copies": ("int", "int"),
}


def _check_list(where: str, value: Any, shape: tuple[str, ...]) -> None:
    if not isinstance(value, list) or len(value) > MAX_ITEMS_PER_MESSAGE:
        raise ProtocolError(f"{where} must be a list of at most {MAX_ITEMS_PER_MESSAGE} items")
    if _WELL_FORMED[shape](value):
        return  # the common case, checked in one quick pass
    for item in value:  # find the bad item and say what is wrong with it
        if not isinstance(item, list) or len(item) != len(shape):
            raise ProtocolError(f"{where} items must be lists of {len(shape)} values")
        for kind, element in zip(shape, item, strict=True):
            if kind == "bool":
                if not isinstance(element, bool):
                    raise ProtocolError(f"{where} items: expected a bool")
            elif kind == "str":
                _check_str(where, element)
            else:
                _check_int(where, element)


# Quick checks of whole lists, one per element shape. They accept a subset of what
# the item-by-item check accepts (exact types: msgpack yields exact int/str/bool/list,
# and ``type(x) is int`` also rules out bool); anything they refuse goes through the
# item check, which decides. Hundreds of slots per message make this the hot path.
def _slots_ok(value: list) -> bool:
    for item in value:
        if type(item) is not list or len(item) != 2:
            return False
        slot_idx, request_id = item
        if (type(slot_idx) is not int or type(request_id) is not int
                or not 0 <= slot_idx <= MAX_INT or not 0 <= request_id <= MAX_INT):
            return False
    return True


def _items_ok(value: list) -> bool:
    for item in value:
        if type(item) is not list or len(item) != 4:
            return False
        medium, slot_idx, stride, request_id = item
        if (type(medium) is not str or len(medium) > MAX_STRING_CHARS
                or type(slot_idx) is not int or type(stride) is not int or type(request_id) is not int
                or not 0 <= slot_idx <= MAX_INT or not 0 <= stride <= MAX_INT
                or not 0 <= request_id <= MAX_INT):
            return False
    return True


def _failed_ok(value: list) -> bool:
    for item in value:
        if type(item) is not list or len(item) != 2:
            return False
        idx, reason = item
        if (type(idx) is not int or not 0 <= idx <= MAX_INT
                or type(reason) is not str or len(reason) > MAX_STRING_CHARS):
            return False
    return True


def _done_slots_ok(value: list) -> bool:
    for item in value:
        if type(item) is not list or len(item) != 3:
            return False
        slot_idx, request_id, ok = item
        if (type(slot_idx) is not int or type(request_id) is not int or type(ok) is not bool
                or not 0 <= slot_idx <= MAX_INT or not 0 <= request_id <= MAX_INT):
            return False
    return True


def _runs_ok(value: list) -> bool:
    for item in value:
        if type(item) is not list or len(item) != 3:
            return False
        run_id, generation, count = item
        if (type(run_id) is not str or len(run_id) > MAX_STRING_CHARS
                or type(generation) is not int or type(count) is not int
                or not 0 <= generation <= MAX_INT or not 0 <= count <= MAX_INT):
            return False
    return True


_WELL_FORMED = {
    _LIST_SHAPES["slots"]: _slots_ok,
    _LIST_SHAPES["items"]: _items_ok,
    _LIST_SHAPES["failed"]: _failed_ok,
    _LIST_SHAPES["done_slots"]: _done_slots_ok,
    _LIST_SHAPES["runs"]: _runs_ok,
}

# Quick checks of single values, by schema kind (same rule: a subset of what the
# full check accepts; on False the full check decides and says why).
_QUICK_CHECKS = {
    "str": lambda v: type(v) is str and len(v) <= MAX_STRING_CHARS,
    "int": lambda v: type(v) is int and 0 <= v <= MAX_INT,
    "dict": lambda v: type(v) is dict and nested_within(v, MAX_CFG_DEPTH, MAX_CFG_NODES),
    "map": lambda v: type(v) is dict and nested_within(v, MAX_CFG_DEPTH, MAX_CONTAINERS),
    "bool": lambda v: type(v) is bool,
    "names": lambda v: type(v) is list and len(v) <= MAX_ITEMS_PER_MESSAGE
    and all(type(s) is str and len(s) <= MAX_STRING_CHARS for s in v),
    **{kind: (lambda v, ok=_WELL_FORMED[shape]: type(v) is list
              and len(v) <= MAX_ITEMS_PER_MESSAGE and ok(v))
       for kind, shape in _LIST_SHAPES.items()},
}
# The schema, parsed once: command -> ((field, kind, optional, quick check), ...).
_FIELDS = {
    command: tuple((key, kind.rstrip("?"), kind.endswith("?"),
                    _QUICK_CHECKS.get(kind.rstrip("?"), lambda v: False))
                   for key, kind in schema.items())
    for command, schema in SCHEMA.items()
}
_COMMANDS = {command.value: command for command in Command}


# --------------------------------------------------------------------------- sockets
# High-water marks: messages ZeroMQ queues per connection (per peer on a ROUTER).
# A full receive queue makes ZeroMQ stop reading from that peer (its sends then
# block: back-pressure, nothing lost); a full send queue blocks a DEALER and makes a
# ROUTER or PUB drop. So each socket's memory is bounded by HWM x message size
# (messages are at most MAX_MESSAGE_BYTES; the usual one is under 1 KiB).
DEFAULT_HWM = 100_000
"""Students' and workers' sockets: far above what a peer ever has outstanding
(a student: one message per slot it owns; a worker: one per slot of credit)."""
BROKER_SNDHWM = 16_384
"""Broker's backend (workers) and broadcasts, per peer: a worker is owed at most one WORK
per slot of its credit; past it the ROUTER drops."""
BROKER_REPLY_HWM = 1024
"""Broker's frontend and control, per connection: replies queued for a peer that does not
read them (ZeroMQ's I/O thread moves a reading peer's replies into its own receive queue,
DEFAULT_HWM deep, whether or not the application has read them yet). These sockets are
ROUTER_MANDATORY and never wait: a reply that does not fit is dropped and its connection
is dropped too (``broker/service.py``), so a peer that floods requests and reads nothing
can park at most this many bounded replies in the broker."""
BROKER_RCVHWM = 16
"""Broker, per peer: messages ZeroMQ holds for it before it stops reading from that peer
(whose sends then wait). A peer has a few messages on their way at most (a worker one
DONE per WORK it holds, a student one REQUEST per flush), so this only binds a flooder."""
BROKER_MAX_MESSAGE_BYTES = 2 * 1024 * 1024
"""Largest message the broker's sockets take (a REQUEST of MAX_ITEMS_PER_MESSAGE slots is
1.25 MB); ZeroMQ drops the connection of a peer that sends a larger one. With
BROKER_RCVHWM this bounds what one peer can park in the broker: 16 x 2 MiB."""


def configure(sock: zmq.Socket, *, hwm: int = DEFAULT_HWM, rcvhwm: int | None = None,
              max_message_bytes: int = MAX_MESSAGE_BYTES) -> zmq.Socket:
    """Socket options every pipeline socket gets: bounded size and queues (``hwm``
    for sending, ``rcvhwm`` for receiving, default ``hwm``), no linger on close."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm if rcvhwm is None else rcvhwm)
    return sock


# Frames below this size are copied into ZeroMQ (cheaper than a zero-copy frame).
ZERO_COPY_MIN_BYTES = 65536
_SNDMORE = int(zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)


def send(sock: zmq.Socket, command: Command, body: dict[str, Any] | None = None, *,
         identity: bytes | None = None, topic: bytes | None = None) -> None:
    """Send one message; ``identity`` for ROUTER sockets, ``topic`` for PUB."""
    send_frames(sock, encode(command, body), identity=identity, topic=topic)


def send_frames(sock: zmq.Socket, frames: list[bytes], *, identity: bytes | None = None,
                topic: bytes | None = None) -> None:
    """Send frames made by :func:`encode` (a sender that must know a message encodes
    before it changes any state encodes first, then sends)."""
    prefix = [identity] if identity is not None else [topic] if topic is not None else []
    *first, last = prefix + frames
    for frame in first:
        sock.send(frame, _SNDMORE)
    sock.send(last, 0, copy=len(last) < ZERO_COPY_MIN_BYTES)


SEND_RETRY_MS = 100
"""Send timeout of the sockets sent on with :func:`send_patiently`: how often a blocked
send looks up from waiting to ask whether to go on."""


def send_patiently(sock: zmq.Socket, command: Command, body: dict[str, Any] | None,
                   go_on: Callable[[], bool]) -> bool:
    """Send one message, waiting as long as ``go_on()`` says to; False when it gave up.

    A DEALER blocks a send while it has no route to its peer, and a send without a
    timeout blocks forever: that happens to a client whose CurveZMQ key the broker
    refuses (ZeroMQ drops the pipe after the failed handshake) and behind a full queue
    to a broker that is gone. ``sock`` needs ``SNDTIMEO`` (:data:`SEND_RETRY_MS`): each
    time it runs out ``go_on`` is asked, and may raise the reason to stop instead.
    Only the first frame of a message can time out, so a message is sent whole or not
    at all.
    """
    while True:
        try:
            send(sock, command, body)
            return True
        except zmq.Again:
            if not go_on():
                return False


def readable(sock: zmq.Socket) -> bool:
    """True when a message is waiting on ``sock`` (``poll(0)`` without a system call)."""
    return bool(sock.getsockopt(_EVENTS) & _POLLIN)


def recv(sock: zmq.Socket) -> Message:
    """Receive one message from a DEALER socket; raises ProtocolError on garbage."""
    return decode(sock.recv_multipart())


def recv_routed(sock: zmq.Socket) -> tuple[bytes, Message | ProtocolError]:
    """Receive one message from a ROUTER: the sender's identity and the message or
    the reason it was refused (so the caller can still answer the sender)."""
    frames = sock.recv_multipart()
    try:
        return frames[0], decode(frames[1:])
    except ProtocolError as exc:
        return frames[0], exc


def recv_published(sock: zmq.Socket) -> Message:
    """Receive one message from a SUB socket (topic frame dropped)."""
    frames = sock.recv_multipart()
    if len(frames) < 2:
        raise ProtocolError("published message without a topic frame")
    return decode(frames[1:])


# --------------------------------------------------------------------------- sample data
def encode_data(generation: int, stride: int, slots: list[list[int]],
                buffers: list[memoryview]) -> list:
    """Frames of one DATA message: the usual three, then one whole slot (header and
    payload) per ``slots`` row. Large buffers go zero-copy: the caller must not write
    into them again (the network medium sends freshly staged buffers only)."""
    frames: list = encode(Command.DATA, {"generation": generation, "stride": stride, "slots": slots})
    frames += [zmq.Frame(buf, copy=False) if len(buf) >= ZERO_COPY_MIN_BYTES else bytes(buf)
               for buf in buffers]
    return frames


def decode_data(frames: list[zmq.Frame]) -> tuple[Message, list[memoryview]]:
    """Parse a DATA message received with ``copy=False``: the message and one view per
    slot frame, each checked to be exactly ``stride`` bytes."""
    if len(frames) < 3:
        raise ProtocolError(f"DATA: expected at least 3 frames, got {len(frames)}")
    msg = decode([frame.bytes for frame in frames[:3]])
    if msg.command is not Command.DATA:
        raise ProtocolError(f"command {msg.command.name} not accepted on a data socket")
    buffers = [frame.buffer for frame in frames[3:]]
    if len(buffers) != len(msg.body["slots"]):
        raise ProtocolError(f"DATA: {len(msg.body['slots'])} slots but {len(buffers)} data frames")
    stride = msg.body["stride"]
    for buf in buffers:
        if len(buf) != stride:
            raise ProtocolError(f"DATA: a {len(buf)}-byte slot frame, stride is {stride}")
    return msg, buffers
