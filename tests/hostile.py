"""Hostile and unlucky peers for broker tests: real DEALER sockets speaking the protocol.

A :class:`Peer` is what a misbehaving student, worker or leader would be: a socket of
its own (with the routing identity it chooses) that sends well-formed messages whose
*content* is hostile (another peer's id, another student's medium, huge counts), or
bodies built byte by byte where msgpack's own packer would refuse (deep nesting).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

from distill.pipeline import protocol
from distill.pipeline.auth import ClientKeys, secure_client
from distill.pipeline.protocol import PROTOCOL_TAG, Command, Message, ProtocolError


class Peer:
    """One connection to one broker socket."""

    def __init__(self, endpoint: str, identity: str | None = None, *, keys: ClientKeys | None = None,
                 sndhwm: int = 1000) -> None:
        self.sock = secure_client(zmq.Context.instance().socket(zmq.DEALER), keys)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, sndhwm)
        if identity is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, identity.encode())
        self.sock.connect(endpoint)

    def send(self, command: Command, body: dict[str, Any]) -> None:
        protocol.send(self.sock, command, body)

    def send_raw(self, command: Command, raw_body: bytes) -> None:
        self.sock.send_multipart([PROTOCOL_TAG, command.value, raw_body])

    def recv(self, timeout_s: float = 5.0) -> Message | None:
        """The next decodable message within ``timeout_s``, or None."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(left * 1000):
                return None
            try:
                return protocol.recv(self.sock)
            except ProtocolError:
                continue
        return None

    def expect(self, command: Command, timeout_s: float = 5.0, *, skip: tuple[Command, ...] = ()) -> Message:
        """The next message, which must be ``command`` (messages of ``skip`` are passed over)."""
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.recv(max(0.0, deadline - time.monotonic()))
            assert msg is not None, f"no {command.name} in {timeout_s}s"
            if msg.command in skip:
                continue
            assert msg.command is command, f"expected {command.name}, got {msg.command.name}: {msg.body}"
            return msg

    def collect(self, command: Command, quiet_s: float = 0.5) -> list[Message]:
        """Every ``command`` message until ``quiet_s`` of silence."""
        got = []
        while (msg := self.recv(quiet_s)) is not None:
            if msg.command is command:
                got.append(msg)
        return got

    def close(self) -> None:
        self.sock.close(0)


def deep_map(depth: int) -> bytes:
    """The msgpack of ``{"a": {"a": ... {}}}`` nested ``depth`` deep (msgpack's packer stops at 511)."""
    return b"\x81\xa1a" * depth + b"\x80"


def raw_body(fields: dict[str, Any], raw_fields: dict[str, bytes]) -> bytes:
    """A msgpack map of ``fields`` (packed normally) and ``raw_fields`` (already packed)."""
    out = bytearray(b"\xde" + (len(fields) + len(raw_fields)).to_bytes(2, "big"))
    for key, value in fields.items():
        out += msgpack.packb(key) + msgpack.packb(value, use_bin_type=True)
    for key, packed in raw_fields.items():
        out += msgpack.packb(key) + packed
    return bytes(out)


def empty_maps(count: int, per_list: int = 65536) -> bytes:
    """The msgpack of lists of ``per_list`` empty maps, ``count`` maps in all (1 byte each on
    the wire, ~64 in memory; in lists that each pass msgpack's ``max_array_len``)."""
    lists = [min(per_list, count - start) for start in range(0, count, per_list)]
    return (b"\xdd" + len(lists).to_bytes(4, "big")
            + b"".join(b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n for n in lists))


def request(peer_id: str, medium: str, slots: list[list[int]], *, stride: int = 4160,
            run_id: str = "default") -> dict[str, Any]:
    return {"run_id": run_id, "peer_id": peer_id, "generation": 0, "medium": medium, "stride": stride,
            "slots": slots}


LEADER_SECRET = "hostile-tests-leader-secret"
"""The leader secret of :func:`set_model` (a run's leader is whoever holds its secret)."""


def set_model(model_id: str = "m", *, run_id: str = "default", peer_id: str = "leader", epoch: int = 1,
              **extra: Any) -> dict[str, Any]:
    return {"run_id": run_id, "model_id": model_id, "leader_epoch": epoch, "peer_id": peer_id,
            "leader_secret": LEADER_SECRET, **extra}


def medium_name(tag: str) -> str:
    """A segment name of our form that no process maps (the broker only routes names)."""
    return f"dst_{tag}_{os.getpid()}_1"


def fetch_stats(frontend_endpoint: str, timeout_s: float = 2.0) -> dict | None:
    """One STATS round trip on a fresh connection; None when the broker does not answer."""
    peer = Peer(frontend_endpoint)
    try:
        peer.send(Command.STATS, {})
        reply = peer.recv(timeout_s)
        return reply.body["stats"] if reply is not None and reply.command is Command.STATS_REPLY else None
    finally:
        peer.close()


def stats_when(frontend_endpoint: str, holds: Callable[[dict], bool], timeout_s: float = 5.0) -> dict | None:
    """The first STATS answer for which ``holds`` is true, asking until ``timeout_s`` passes;
    the last answer otherwise. The broker keeps its encoded answer up to
    ``report.MAX_AGE_S``, so an answer right after an event may predate it."""
    deadline = time.monotonic() + timeout_s
    stats = fetch_stats(frontend_endpoint)
    while (stats is None or not holds(stats)) and time.monotonic() < deadline:
        time.sleep(0.02)
        stats = fetch_stats(frontend_endpoint)
    return stats


def samples_per_s(client, generation: int, seconds: float, watch: Callable[[], None] | None = None) -> float:
    """A good student's samples/s over ``seconds`` (each of ``generation``; none may take
    5 s); ``watch`` is called after each sample."""
    count, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        ref = client.request_sample(timeout_ms=5000)
        assert ref is not None, "the good student got no sample for 5 s"
        assert ref.generation == generation
        client.release_slot(ref.slot_id)
        count += 1
        if watch is not None:
            watch()
    return count / seconds


FLOOD_KINDS = ("maps", "oversized", "requests")


def flood_frames(kind: str, peer_id: str, seq: int) -> list[bytes]:
    """One flood message: ``maps``, a REQUEST of ~1.9 MiB of empty maps (the cheapest bytes to
    send, the dearest to unpack); ``oversized``, the same at ~4 MiB (the protocol's old message
    limit); ``requests``, a valid REQUEST of 8,192 fresh slots (refused, answered with its slots);
    ``stats``, a STATS (a few bytes asking for the broker's largest answer)."""
    if kind == "stats":
        return protocol.encode(Command.STATS, {})
    if kind == "requests":
        return protocol.encode(Command.REQUEST, request(peer_id, medium_name(f"flood{peer_id[-4:]}"),
                                                        [[i, seq * 8192 + i] for i in range(8192)]))
    count = (1_900_000 if kind == "maps" else 4 * 2**20 - 4096)
    body = raw_body({"run_id": "default", "peer_id": peer_id, "generation": 0, "medium": "dst_flood_1_1",
                     "stride": 4160}, {"slots": empty_maps(count)})
    return [PROTOCOL_TAG, Command.REQUEST.value, body]


def run_flooder(endpoint: str, kinds: tuple[str, ...], seconds: float, counts, per_s: float | None = None,
                started=None) -> None:
    """A peer that sends flood messages of ``kinds`` in turn, as fast as the broker takes
    them (or ``per_s`` a second: on a machine of two cores a flooder that spins takes a core
    from everyone, whatever the broker does) and reading none of the answers, for
    ``seconds``; puts what it sent into ``counts``. Sets the event ``started`` (if any) as
    it starts sending (its process has imported what it needs: no longer busy itself)."""
    peer_id = f"flooder-{os.getpid()}"
    peer = Peer(endpoint, peer_id)
    if started is not None:
        started.set()
    frames = {kind: flood_frames(kind, peer_id, 0) for kind in kinds}
    sent = dict.fromkeys(kinds, 0)
    started = time.monotonic()
    end = started + seconds
    try:
        while time.monotonic() < end:
            if per_s is not None and sum(sent.values()) >= per_s * (time.monotonic() - started):
                time.sleep(0.005)
                continue
            for kind in kinds:
                if kind == "requests":
                    frames[kind] = flood_frames(kind, peer_id, sent[kind] + 1)
                try:
                    peer.sock.send_multipart(frames[kind], zmq.NOBLOCK)
                    sent[kind] += 1
                except zmq.Again:
                    peer.sock.poll(50, zmq.POLLOUT)
    finally:
        counts.put(sent)
        peer.close()


def run_queue_hog(endpoint: str, run_id: str, connections: int, peers_per_connection: int,
                  slots_per_peer: int, seconds: float, counts) -> None:
    """Issue 37's queue hog: ``connections`` free connections, each speaking for
    ``peers_per_connection`` student peer ids of ``run_id`` (a run nobody serves), ask for
    ``slots_per_peer`` fresh slots per peer id, again every half second; one more socket
    beats for every one of those peer ids. Reads none of the answers; puts the slots it
    asked for and the beats it sent into ``counts``."""
    tag = f"hog{os.getpid()}"
    socks = [Peer(endpoint, f"{tag}-c{c}", sndhwm=0) for c in range(connections)]
    beats = Peer(endpoint, f"{tag}-beats", sndhwm=0)
    peer_ids = [[f"{tag}-c{c}-p{p}" for p in range(peers_per_connection)] for c in range(connections)]
    asked = sent_beats = round_idx = 0
    next_ask, end = 0.0, time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if time.monotonic() >= next_ask:
                for c, peer in enumerate(socks):
                    for p, peer_id in enumerate(peer_ids[c]):
                        first = (round_idx * peers_per_connection + p) * slots_per_peer
                        peer.send(Command.REQUEST, request(peer_id, medium_name(f"{tag}c{c}"), run_id=run_id,
                                                           slots=[[first + i, first + i] for i in range(slots_per_peer)]))
                        asked += slots_per_peer
                round_idx += 1
                next_ask = time.monotonic() + 0.5
            for peer_id in (p for ids in peer_ids for p in ids):
                beats.send(Command.HEARTBEAT, {"peer_id": peer_id, "role": "student"})
                sent_beats += 1
            time.sleep(0.1)
    finally:
        counts.put({"asked": asked, "beats": sent_beats})
        for peer in (*socks, beats):
            peer.close()
