"""The network medium: students whose workers run on other machines (``pipeline=tcp``).

The student's slots are still one shared-memory segment (so a worker on the
student's own machine keeps writing into it directly), plus a ZeroMQ PULL socket
bound on TCP. The medium's name, which is all the broker ever routes, says both::

    tcp://<host>:<port>/<host id>.<st_dev>.<st_ino>/<segment name>
    \\___ data endpoint ___/ \\___ which file, on which kernel ___/

A worker maps the segment only when it is provably the same file (same kernel boot
id, same device and inode: a same-named segment of another container or machine
is never touched). Otherwise it fills freshly staged slot buffers and sends them,
header and payload, in one DATA message per batch (zero-copy for large slots) to the
data endpoint. The student's :meth:`TcpMedium.receive` copies each one into its
slot only if that slot is waiting for exactly that request id and the frame is
exactly one stride long; then the usual COMPLETE path checks the header (magic,
generation, request id, length, checksum), as for shared memory.

DATA and the broker's COMPLETE travel on different connections, so either can
arrive first: a COMPLETE whose data is not there yet leaves the slot *awaiting*
(see ``client.py``), not refused.

The data socket accepts any peer that can reach it: on an untrusted network turn on
CurveZMQ, or keep the port to the cluster's private network (README, "Running on a
cluster").
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import socket
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import zmq

from distill.pipeline import protocol
from distill.pipeline.mediums.shm import SHM_DIR, SharedMemoryManager, is_our_name
from distill.pipeline.protocol import ProtocolError
from distill.pipeline.slot import HEADER_BYTES

log = logging.getLogger(__name__)

TCP_SCHEME = "tcp://"
DATA_RCVHWM = 64
"""DATA messages (batches) a student's socket queues before senders wait."""
DATA_SNDHWM = 16
"""DATA messages a worker queues per student before it reports the slots as failed."""
MAX_SENDER_SOCKETS = 256
_NAME_RE = re.compile(r"^(tcp://[A-Za-z0-9.\-]{1,100}:\d{1,5})/([0-9a-f]{1,32})\.(\d{1,20})\.(\d{1,20})/([^/]+)$")


@dataclass(frozen=True)
class TcpAddress:
    """A network medium's name, parsed."""

    endpoint: str
    host_id: str
    st_dev: int
    st_ino: int
    segment: str


def is_tcp_medium(name: str) -> bool:
    return name.startswith(TCP_SCHEME)


def parse_medium(name: str) -> TcpAddress:
    """Split a network medium's name; ValueError when it is not one of ours."""
    match = _NAME_RE.match(name)
    if match is None or not is_our_name(match.group(5)):
        raise ValueError(f"{name[:80]!r} is not a distill network medium "
                         "(tcp://host:port/<host id>.<dev>.<inode>/<segment>)")
    endpoint, host, dev, ino, segment = match.groups()
    return TcpAddress(endpoint, host, int(dev), int(ino), segment)


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


class TcpMedium(SharedMemoryManager):
    """A student's slots that workers on other machines fill over TCP (module docstring)."""

    def __init__(self, slot_count: int, slot_stride: int, run_id: str | None = None,
                 host: str | None = None) -> None:
        super().__init__(slot_count, slot_stride, read_only=True, run_id=run_id)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RCVHWM, DATA_RCVHWM)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max(slot_stride, protocol.MAX_MESSAGE_BYTES))
        host = host or default_host()
        try:
            self._sock.bind(f"tcp://{host}:*")
        except zmq.ZMQError as exc:
            self.close()
            raise ValueError(f"cannot listen on {host!r} ({exc}): set pipeline.tcp_host to an "
                             "address of this machine that the workers can reach") from None
        self.data_endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        st = os.stat(os.path.join(SHM_DIR, super().buf_name))
        self._tcp_name = f"{self.data_endpoint}/{host_id()}.{st.st_dev}.{st.st_ino}/{super().buf_name}"
        self.counts = {"received": 0, "dropped": 0}

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
                log.warning("%s: refused data: %s", self.data_endpoint, exc.reason)
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
            self._ctx.term()
            self._sock = None
        super().close()


class TcpSender:
    """A worker's side of the network medium: staging buffers and one PUSH socket per
    student data endpoint (least recently used ones closed beyond MAX_SENDER_SOCKETS)."""

    def __init__(self) -> None:
        self._ctx: zmq.Context | None = None
        self._socks: OrderedDict[str, zmq.Socket] = OrderedDict()
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
        endpoint = parse_medium(medium).endpoint
        try:
            sock = self._socket(endpoint)
            sock.send_multipart(protocol.encode_data(generation, stride, slots, buffers), zmq.NOBLOCK)
        except zmq.Again:
            return f"student data endpoint {endpoint} is not taking data (gone or too slow)"
        except zmq.ZMQError as exc:
            return f"cannot send to {endpoint}: {exc}"
        self.samples_sent += len(slots)
        return None

    def _socket(self, endpoint: str) -> zmq.Socket:
        sock = self._socks.get(endpoint)
        if sock is None:
            if self._ctx is None:
                self._ctx = zmq.Context()
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, DATA_SNDHWM)
            sock.connect(endpoint)
            self._socks[endpoint] = sock
            while len(self._socks) > MAX_SENDER_SOCKETS:
                self._socks.popitem(last=False)[1].close(linger=0)
        self._socks.move_to_end(endpoint)
        return sock

    def close(self, linger_ms: int = 1000) -> None:
        """Close every socket, giving queued data ``linger_ms`` to leave."""
        for sock in self._socks.values():
            sock.close(linger=linger_ms)
        self._socks.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
