"""The network medium: students whose workers run on other machines (``pipeline=tcp``).

The student's slots are still one shared-memory segment (so a worker on the
student's own machine keeps writing into it directly), plus a ZeroMQ PULL socket
bound on TCP. The medium's name, which is all the broker ever routes, says both::

    tcp://<host>:<port>/<host id>.<st_dev>.<st_ino>[.<data key>]/<segment name>
    \\___ data endpoint ___/ \\___ which file, on which kernel ___/

A worker maps the segment only when it is provably the same file (same kernel boot
id, device and inode); otherwise it sends staged slots in one DATA message per batch,
which :meth:`TcpMedium.receive` copies into a slot only if that slot waits for exactly
that request id and the frame is exactly one stride long. DATA and the broker's
COMPLETE travel on different connections, so a COMPLETE whose data is not there yet
leaves the slot *awaiting* (``student/slots.py``), not refused. See docs/cluster.md,
section The network medium.

Who may send DATA. Every data socket authenticates its peers (ZeroMQ's ZAP handler, in
the student's process) with a random 32-byte *data key* the student draws for each
medium and puts in the medium's name, so that it travels only through the broker's
sockets. A peer without the key completes no handshake, so nothing it sends is ever
queued in the student (ZeroMQ's queue limit counts messages, and a message may have
any number of parts: only authentication bounds what a stranger can make us hold).
With CurveZMQ on (the pipeline's ``curve``), the data socket is a CurveZMQ server keyed
by the data key, and the only client key it admits is derived from it
(:func:`writer_keys`): the samples are encrypted too, and the key never crosses the
network in clear. Without CurveZMQ it is a ZeroMQ PLAIN server whose password is the
data key: the key then travels in clear (keep such a cluster on its private network).
The key never appears in a log line: :func:`medium_label` is the name without it.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import logging
import os
import re
import secrets
import socket
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zmq
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from distill.pipeline import protocol
from distill.pipeline.mediums.shm import SHM_DIR, SharedMemoryManager, is_our_name
from distill.pipeline.protocol import ProtocolError
from distill.pipeline.slot import HEADER_BYTES
from distill.pipeline.throttle import LogThrottle

log = logging.getLogger(__name__)

TCP_SCHEME = "tcp://"
DATA_RCVHWM = 4
"""DATA messages (batches) one connection to a student's socket queues before its sender
waits: what any one peer can make the student hold, at most, in slot-sized frames."""
DATA_SNDHWM = 16
"""DATA messages a worker queues per student before it reports the slots as failed."""
MAX_SENDER_SOCKETS = 256
DATA_KEY_BYTES = 32
ZAP_DOMAIN = "distill-data"
_WRITER_PERSON = b"distill-writer"
PLAIN_USER = "distill"
_NAME_RE = re.compile(r"^(tcp://[A-Za-z0-9.\-]{1,100}:\d{1,5})/([0-9a-f]{1,32})\.(\d{1,20})\.(\d{1,20})"
                      r"\.([cp])([A-Za-z0-9_\-]{43})/([^/]+)$")


@dataclass(frozen=True)
class TcpAddress:
    """A network medium's name, parsed."""

    endpoint: str
    host_id: str
    st_dev: int
    st_ino: int
    segment: str
    data_key: bytes = b""
    """The medium's data key (module docstring)."""
    curve: bool = False
    """A CurveZMQ data socket (else PLAIN, the data key as its password)."""


def is_tcp_medium(name: str) -> bool:
    return name.startswith(TCP_SCHEME)


def parse_medium(name: str) -> TcpAddress:
    """Split a network medium's name; ValueError when it is not one of ours."""
    match = _NAME_RE.match(name)
    if match is None or not is_our_name(match.group(7)):
        raise ValueError(f"{medium_label(name)[:80]!r} is not a distill network medium "
                         "(tcp://host:port/<host id>.<dev>.<inode>.<key>/<segment>)")
    endpoint, host, dev, ino, kind, key, segment = match.groups()
    return TcpAddress(endpoint, host, int(dev), int(ino), segment, base64.urlsafe_b64decode(key + "="),
                      kind == "c")


def medium_label(name: str) -> str:
    """A medium's name fit for logs: a network medium's data key left out."""
    if not is_tcp_medium(name):
        return name
    return re.sub(r"(/[0-9a-f]{1,32}\.\d{1,20}\.\d{1,20}\.[cp])[A-Za-z0-9_\-]{43}/", r"\1<key>/", name)


def writer_keys(data_key: bytes) -> tuple[bytes, bytes]:
    """(public, secret) z85 CurveZMQ keys of the medium's writers, derived from its data key."""
    secret = hashlib.blake2b(data_key, digest_size=32, person=_WRITER_PERSON).digest()
    secret_z85 = zmq.utils.z85.encode(secret)
    return zmq.curve_public(secret_z85), secret_z85


def server_keys(data_key: bytes) -> tuple[bytes, bytes]:
    """(public, secret) z85 CurveZMQ keys of the student's data socket."""
    secret_z85 = zmq.utils.z85.encode(data_key)
    return zmq.curve_public(secret_z85), secret_z85


@functools.cache
def host_id() -> str:
    """This kernel's boot id (machines, and reboots, differ); the hostname's hash elsewhere."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace("-", "")[:32]
    except OSError:
        return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:32]


def default_host() -> str:
    """The address other machines reach this one at, by the hostname's DNS entry."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def maps_locally(address: TcpAddress) -> bool:
    """True when the medium's segment is a file this process can map: same kernel, and
    the ``/dev/shm`` entry of that name is the very file the student created."""
    if address.host_id != host_id():
        return False
    try:
        st = os.stat(os.path.join(SHM_DIR, address.segment))
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (address.st_dev, address.st_ino)


def plain_password(data_key: bytes) -> bytes:
    """The PLAIN password of a data socket without CurveZMQ."""
    return base64.urlsafe_b64encode(data_key)


class _Gate(ThreadAuthenticator):
    """The data socket's ZAP handler: admits the medium's writer key (CurveZMQ) or its
    password (PLAIN) only; refusals are counted and logged at a bounded rate (a stranger
    may keep reconnecting)."""

    def __init__(self, context: zmq.Context, data_key: bytes, label: str) -> None:
        super().__init__(context, log=log.getChild("zap"))
        self._writer_public = writer_keys(data_key)[0]
        self._password = plain_password(data_key)
        self._label = label
        self.refused = 0
        self._refusals = LogThrottle(log)

    def start(self) -> _Gate:
        super().start()
        self.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self)
        return self

    def callback(self, domain: str, key: bytes) -> bool:
        """CurveZMQ: is this the medium's writer key?"""
        return self._admit(hmac.compare_digest(key, self._writer_public))

    def _authenticate_plain(self, domain: str, username: str, password: str) -> tuple[bool, bytes]:
        """PLAIN: the medium's password? (pyzmq's own check would log the password.)"""
        ok = self._admit(username == PLAIN_USER and hmac.compare_digest(password.encode(), self._password))
        return ok, b"OK" if ok else b"not this medium's key"

    def _admit(self, ok: bool) -> bool:
        if not ok:
            self.refused += 1
            self._refusals.warning("%s: refused a data connection without this medium's key", self._label)
        return ok


class TcpMedium(SharedMemoryManager):
    """A student's slots that workers on other machines fill over TCP (module docstring)."""

    def __init__(self, slot_count: int, slot_stride: int, run_id: str | None = None,
                 host: str | None = None, *, payload_bytes: int = 0, secure: bool = False) -> None:
        """``secure``: a CurveZMQ data socket (the pipeline's keys are on), else PLAIN."""
        super().__init__(slot_count, slot_stride, read_only=True, run_id=run_id, payload_bytes=payload_bytes)
        self._ctx = zmq.Context()
        self._authenticator: _Gate | None = None
        self._sock = None
        self.counts = {"received": 0, "dropped": 0}
        self._refusals = LogThrottle(log)
        data_key = secrets.token_bytes(DATA_KEY_BYTES)
        try:
            self._sock = self._ctx.socket(zmq.PULL)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.RCVHWM, DATA_RCVHWM)
            self._sock.setsockopt(zmq.MAXMSGSIZE, max(slot_stride, protocol.MAX_MESSAGE_BYTES))
            self._guard(data_key, secure)
            host = host or default_host()
            try:
                self._sock.bind(f"tcp://{host}:*")
            except zmq.ZMQError as exc:
                raise ValueError(f"cannot listen on {host!r} ({exc}): set pipeline.tcp_host to an "
                                 "address of this machine that the workers can reach") from None
        except BaseException:
            self.close()
            raise
        self.data_endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        st = os.stat(os.path.join(SHM_DIR, super().buf_name))
        key = ("c" if secure else "p") + base64.urlsafe_b64encode(data_key).decode().rstrip("=")
        self._tcp_name = f"{self.data_endpoint}/{host_id()}.{st.st_dev}.{st.st_ino}.{key}/{super().buf_name}"
        if len(self._tcp_name) > protocol.MAX_STRING_CHARS:
            self.close()
            raise ValueError(f"the network medium's name would be {len(self._tcp_name)} characters, over the "
                             f"protocol's {protocol.MAX_STRING_CHARS}: set pipeline.tcp_host to an IP address")

    def _guard(self, data_key: bytes, curve: bool) -> None:
        """Admit only peers that hold the medium's data key (module docstring)."""
        self._authenticator = _Gate(self._ctx, data_key, super().buf_name).start()
        if curve:
            self._sock.curve_secretkey = server_keys(data_key)[1]
            self._sock.curve_publickey = server_keys(data_key)[0]
            self._sock.curve_server = True
        else:
            self._sock.plain_server = True
        self._sock.zap_domain = ZAP_DOMAIN.encode()

    @property
    def refused(self) -> int:
        """Data connections refused for want of the medium's key."""
        return 0 if self._authenticator is None else self._authenticator.refused

    @property
    def buf_name(self) -> str:
        return self._tcp_name

    @property
    def socket(self) -> zmq.Socket:
        """The data socket (poll it for POLLIN, then call :meth:`receive`)."""
        return self._sock

    def receive(self, expected: Callable[[int], int | None]) -> list[int]:
        """Copy every DATA message waiting into its slots; returns the slots written.

        ``expected(slot)`` is the request id the slot waits for (None: not waiting);
        anything else (late, foreign, out of bounds, malformed) is dropped and counted.
        """
        written: list[int] = []
        while protocol.readable(self._sock):
            frames = self._sock.recv_multipart(copy=False)
            try:
                msg, buffers = protocol.decode_data(frames)
                if msg.body["stride"] != self.slot_stride:
                    raise ProtocolError(f"DATA: stride {msg.body['stride']} != {self.slot_stride}")
            except ProtocolError as exc:
                self.counts["dropped"] += 1
                self._refusals.warning("%s: refused data: %s", self.data_endpoint, exc.reason)
                continue
            for (slot_idx, request_id), data in zip(msg.body["slots"], buffers, strict=True):
                if slot_idx >= self.slot_count or expected(slot_idx) != request_id:
                    self.counts["dropped"] += 1
                    continue
                view = self.slot_view(slot_idx)
                view[HEADER_BYTES:] = data[HEADER_BYTES:]
                view[:HEADER_BYTES] = data[:HEADER_BYTES]  # the header last, as workers do
                written.append(slot_idx)
        self.counts["received"] += len(written)
        return written

    def close(self) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            sock.close(linger=0)
            self._sock = None
        if getattr(self, "_authenticator", None) is not None:
            self._authenticator.stop()
            self._authenticator = None
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            ctx.term()
            self._ctx = None
        super().close()


class TcpSender:
    """A worker's side of the network medium: staging buffers and one PUSH socket per
    student data endpoint (least recently used ones closed beyond MAX_SENDER_SOCKETS)."""

    def __init__(self) -> None:
        self._ctx: zmq.Context | None = None
        self._socks: OrderedDict[tuple[str, bytes], zmq.Socket] = OrderedDict()
        self._local: dict[str, bool] = {}
        self.samples_sent = 0

    def is_remote(self, medium: str, local_shm: bool = True) -> bool:
        """True when ``medium`` is a network medium this process cannot map (cached)."""
        remote = self._local.get(medium)
        if remote is None:
            address = parse_medium(medium)
            remote = self._local[medium] = not (local_shm and maps_locally(address))
            if len(self._local) > 4 * MAX_SENDER_SOCKETS:
                self._local.pop(next(iter(self._local)))
        return remote

    @staticmethod
    def stage(stride: int) -> memoryview:
        """A fresh writable slot buffer (never reused: a sent one may still be in flight)."""
        return memoryview(np.empty(stride, dtype=np.uint8))

    def send(self, medium: str, generation: int, stride: int, slots: list[list[int]],
             buffers: list[memoryview]) -> str | None:
        """Queue one DATA message to the student; None when queued, else why not."""
        address = parse_medium(medium)
        try:
            sock = self._socket(address)
            sock.send_multipart(protocol.encode_data(generation, stride, slots, buffers), zmq.NOBLOCK)
        except zmq.Again:
            return f"student data endpoint {address.endpoint} is not taking data (gone or too slow)"
        except zmq.ZMQError as exc:
            return f"cannot send to {address.endpoint}: {exc}"
        self.samples_sent += len(slots)
        return None

    def _socket(self, address: TcpAddress) -> zmq.Socket:
        key = (address.endpoint, address.data_key)
        sock = self._socks.get(key)
        if sock is None:
            if self._ctx is None:
                self._ctx = zmq.Context()
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, DATA_SNDHWM)
            if address.curve:
                sock.curve_serverkey = server_keys(address.data_key)[0]
                sock.curve_publickey, sock.curve_secretkey = writer_keys(address.data_key)
            else:
                sock.plain_username = PLAIN_USER.encode()
                sock.plain_password = plain_password(address.data_key)
            sock.connect(address.endpoint)
            self._socks[key] = sock
            while len(self._socks) > MAX_SENDER_SOCKETS:
                self._socks.popitem(last=False)[1].close(linger=0)
        self._socks.move_to_end(key)
        return sock

    def close(self, linger_ms: int = 1000) -> None:
        """Close every socket, giving queued data ``linger_ms`` to leave."""
        for sock in self._socks.values():
            sock.close(linger=linger_ms)
        self._socks.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
