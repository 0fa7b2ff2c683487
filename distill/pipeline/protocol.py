"""The wire protocol: every command and message schema of the pipeline, in one place.

This is the only module that knows about frames and msgpack. Everything that
crosses a socket is built by :func:`encode` and checked by :func:`decode`, which
raises :class:`ProtocolError` (never ``AssertionError``) so that a peer sending
garbage is logged and answered, and the receiver keeps serving.

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

Workers count what they filled for DIRECT requests (which the broker never sees) in
READY and HEARTBEAT: ``direct`` maps a run id to ``[filled, failed]`` slots so far,
from which the broker's statistics add what is new. The broker's HEARTBEAT answers
carry its ``interval_ms``: a peer that beats more slowly speeds up to it (a student
served by direct requests sends the broker nothing but beats).

A worker that stops answering may still be writing into the slots it was given
(frozen, not dead). Its slots are not handed to anyone else: the broker sends the
student QUARANTINE (with the worker's process token, see ``liveness.process_token``),
and RELEASE when the worker's late DONE proves it is done with them; the student
also frees them itself once that process is gone. The broker never sees DIRECT
requests, so its QUARANTINE for a silent worker also says ``direct``: "and the
slots you asked of this process directly"; the student quarantines those too and
frees each when that worker's late answer to it (notice or DECLINED) comes.
SET_MODEL carries the leader's epoch: a switch from an older epoch than the run has
seen is refused. A switch also carries ``min_generation`` (the leader's newest generation
+ 1): the new model's generation is above both the run's and that, so a broker that
restarted (and counts from 0 again) never gives a new model an older model's number; a
restore (``restore_generation``) puts the leader's model back at its own number.

Fan-out (opt-in, ``SET_MODEL.share_model``): runs that declare the same model
(equal ``model_id`` and ``model_cfg``) may be served by one WORK. Its ``runs``
field cuts ``items`` into consecutive groups, each of its own run and generation
(the top-level ``run_id``/``generation`` are those of the first group), and
``copies`` says which items get the very sample made for another item (its
*source*, never itself a copy): the worker computes each source once and copies
its payload into every copy's slot, whose header still carries the copy's own
request id and generation. A WORK without ``runs`` is the plain, one-run WORK; one of
an opted-in run says ``shared``, and its worker offers no direct requests for it (they
would bypass the broker, which could then never share that run's samples).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

PROTOCOL_VERSION = 5
"""Bumped when a peer of the previous version would refuse or misread a message
(2: DONE.notified; a version-1 broker would refuse such a DONE and strand its work.
3: COMPLETE.lane and the DIRECT/DECLINED datagrams; a version-2 student would drop a
notice naming a lane, and its slots, already done at the broker, would never complete.
4: QUARANTINE.direct; a version-3 student would refuse it and keep waiting on the slots
it asked of a silent worker directly.
5: slot headers of version 2 (writer claims, ``slot.py``), segment headers, keyed data
sockets (``mediums/tcp.py``) and SET_MODEL.min_generation; a version-4 worker's
headers would be refused by every student, and a version-4 broker would refuse the
leader's switches)."""
PROTOCOL_TAG = b"DST" + bytes([PROTOCOL_VERSION])

# Bounds on untrusted input. A message larger than this is dropped by ZeroMQ itself
# (socket option MAXMSGSIZE) before we ever see it.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_ITEMS_PER_MESSAGE = 65536
MAX_STRING_CHARS = 255
MAX_INT = 2**63 - 1


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
# Each field: name -> kind. Kinds: "str", "int" (0..MAX_INT), "sint" (signed int),
# "float", "bool", "dict" (msgpack map of plain values), "names" (a list of "str"),
# or a list kind ("slots", "items", "failed", "done_slots") checked element-wise below.
# A trailing "?" marks an optional field.

SCHEMA: dict[Command, dict[str, str]] = {
    Command.HELLO: {"run_id": "str", "peer_id": "str", "rank": "int?"},
    Command.WELCOME: {"run_id": "str", "generation": "int", "model_id": "str?", "model_cfg": "dict?",
                      "heartbeat_interval_ms": "int"},
    Command.REQUEST: {"run_id": "str", "peer_id": "str", "generation": "int", "medium": "str",
                      "stride": "int", "slots": "slots"},
    Command.READY: {"peer_id": "str", "credit": "int", "max_batch": "int", "process": "str?",
                    "direct": "dict?"},
    Command.WORK: {"work_id": "int", "run_id": "str", "generation": "int", "model_id": "str",
                   "model_cfg": "dict?", "items": "items", "runs": "runs?", "copies": "copies?",
                   "shared": "bool?"},
    Command.DONE: {"peer_id": "str", "work_id": "int", "num_items": "int", "failed": "failed",
                   "notified": "names?"},
    Command.COMPLETE: {"generation": "int", "slots": "done_slots", "lane": "str?", "process": "str?"},
    Command.DISCARDED: {"generation": "int", "slots": "slots"},
    Command.QUARANTINE: {"slots": "slots", "process": "str?", "direct": "bool?"},
    Command.RELEASE: {"slots": "slots"},
    Command.SET_MODEL: {"run_id": "str", "model_id": "str", "model_cfg": "dict?",
                        "restore_generation": "int?", "min_generation": "int?", "leader_epoch": "int",
                        "peer_id": "str", "share_model": "bool?"},
    Command.MODEL_SET: {"run_id": "str", "generation": "int", "model_id": "str"},
    Command.MODEL: {"run_id": "str", "generation": "int", "model_id": "str", "model_cfg": "dict?"},
    Command.STOP: {"run_id": "str?"},
    Command.STATS: {"run_id": "str?"},
    Command.STATS_REPLY: {"stats": "dict"},
    Command.HEARTBEAT: {"peer_id": "str", "role": "str", "direct": "dict?", "interval_ms": "int?"},
    Command.RECONNECT: {},
    Command.BYE: {"peer_id": "str"},
    Command.ERROR: {"reason": "str", "command": "str?", "slots": "slots?"},
    Command.DATA: {"generation": "int", "stride": "int", "slots": "slots"},
    Command.DIRECT: {"run_id": "str", "peer_id": "str", "generation": "int", "medium": "str",
                     "stride": "int", "slots": "slots"},
    Command.DECLINED: {"generation": "int", "slots": "slots", "reason": "str"},
}


def encode(command: Command, body: dict[str, Any] | None = None) -> list[bytes]:
    """Frames for ``command`` with ``body``, validated as ``decode`` would, except the
    items inside slot lists: we built those from validated input, and the receiver
    checks them anyway (checking hundreds of them twice would double the cost)."""
    body = {} if body is None else body
    _validate(command, body, check_items=False)
    return [PROTOCOL_TAG, command.value, msgpack.packb(body, use_bin_type=True)]


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
    try:
        body = msgpack.unpackb(raw_body, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types on garbage
        raise ProtocolError(f"{command.name}: body is not msgpack ({type(exc).__name__})") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"{command.name}: body must be a map, got {type(body).__name__}")
    _validate(command, body)
    return Message(command, body)


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
    elif kind == "dict":
        if not isinstance(value, dict):
            raise ProtocolError(f"{where} must be a map")
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
    "dict": lambda v: type(v) is dict,
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
"""Broker, per peer. A student is owed at most one COMPLETE per slot it queued, so
this must stay above the broker's ``max_queued_per_student``; past it the broker's
ROUTER drops (what it drops is then ERRORs to a peer that floods and never reads)."""
BROKER_RCVHWM = 1_000
"""Broker, per peer: what a flooding peer can park in the broker's memory (the
broker reads up to 1,000 messages of a socket per pass anyway)."""


def configure(sock: zmq.Socket, *, hwm: int = DEFAULT_HWM, rcvhwm: int | None = None) -> zmq.Socket:
    """Socket options every pipeline socket gets: bounded size and queues (``hwm``
    for sending, ``rcvhwm`` for receiving, default ``hwm``), no linger on close."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
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
    frames = encode(command, body)
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
