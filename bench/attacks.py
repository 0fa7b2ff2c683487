"""The attacks of issue 37 that cost a good student time or the broker memory, as bench peers.

``memory.py --only-fairness`` runs a good student beside each in turn and prints what it
keeps. Each attack is a child process (``children.Children``) that sends while the event
``on`` is set and reads none of the broker's answers, as an attacker would:

- ``bodies``: REQUESTs of ~1.9 MiB of empty maps, of ~4 MiB (the old message limit), and
  valid REQUESTs of 8,192 fresh slots, in the good student's own run;
- ``hellos``: two connections sending HELLOs for the good student's run (whose
  ``model_cfg`` is 60 KB): each WELCOME used to carry it, and unread ones piled up;
- ``stats``: 1,000 runs made by HELLOs, then two connections asking STATS without pause
  (each answer used to walk and send every run);
- ``hog``: eight free connections of another run, nobody serving it, asking for 8,192
  fresh slots per peer id (four each) every half second, kept alive by HEARTBEATs sent
  for all their peer ids from one more socket (it used to take the whole ``max_queued``);
- ``runs``: SET_MODELs for made-up run ids, as fast as the broker takes them (they used
  to fill the run table for the broker's life).

They are written with raw ZeroMQ and the protocol's encoder (a hostile peer does not use
our client); the tests' versions of the same attacks live in ``tests/hostile.py``.
"""

from __future__ import annotations

import os
import time

import msgpack
import zmq
from children import child_init  # bench/children.py

from distill.pipeline import protocol
from distill.pipeline.protocol import PROTOCOL_TAG, Command

ATTACKS = ("bodies", "hellos", "stats", "hog", "runs")
BIG_MODEL_CFG = {"blob": "x" * 60_000}
"""The good student's run's model_cfg in every window: what a WELCOME would repeat."""
HOG_CONNECTIONS, HOG_PEERS, HOG_SLOTS = 8, 4, 8192
STATS_RUNS = 1000


def _dealer(endpoint: str, identity: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    return sock


def _send(sock: zmq.Socket, frames: list[bytes]) -> bool:
    """Send without blocking; False (after a short wait for room) when the pipe is full."""
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
        return True
    except zmq.Again:
        sock.poll(50, zmq.POLLOUT)
        return False


def _request(run_id: str, peer_id: str, medium: str, first: int, count: int) -> list[bytes]:
    return protocol.encode(Command.REQUEST, {"run_id": run_id, "peer_id": peer_id, "generation": 0,
                                             "medium": medium, "stride": 4160,
                                             "slots": [[first + i, first + i] for i in range(count)]})


def _empty_maps_request(peer_id: str, count: int) -> list[bytes]:
    """A REQUEST whose ``slots`` are ``count`` empty maps: the cheapest bytes to send, the dearest to unpack."""
    head = {"run_id": "default", "peer_id": peer_id, "generation": 0, "medium": f"dst_flood_{os.getpid()}_1",
            "stride": 4160}
    lists = [min(65536, count - start) for start in range(0, count, 65536)]
    slots = (b"\xdd" + len(lists).to_bytes(4, "big")
             + b"".join(b"\xdd" + n.to_bytes(4, "big") + b"\x80" * n for n in lists))
    packed = b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in head.items())
    return [PROTOCOL_TAG, Command.REQUEST.value,
            b"\xde" + (len(head) + 1).to_bytes(2, "big") + packed + msgpack.packb("slots") + slots]


def _bodies(endpoints: dict[str, str], on, sent) -> None:
    peer_id = f"flooder-{os.getpid()}"
    sock = _dealer(endpoints["frontend"], peer_id)
    heavy = [_empty_maps_request(peer_id, 1_900_000), _empty_maps_request(peer_id, 4 * 2**20 - 4096)]
    seq = 0
    while True:
        on.wait()
        seq += 1
        for frames in (*heavy, _request("default", peer_id, f"dst_flood_{os.getpid()}_1", seq * 8192, 8192)):
            sent.value += _send(sock, frames)


def _hellos(endpoints: dict[str, str], on, sent) -> None:
    socks = [_dealer(endpoints["frontend"], f"hellos-{os.getpid()}-{c}") for c in range(2)]
    seq = 0
    while True:
        on.wait()
        for c, sock in enumerate(socks):
            seq += 1
            sent.value += _send(sock, protocol.encode(Command.HELLO, {
                "run_id": "default", "peer_id": f"hello-{os.getpid()}-{c}-{seq}", "rank": 0}))


def _stats(endpoints: dict[str, str], on, sent) -> None:
    maker = _dealer(endpoints["frontend"], f"runs-{os.getpid()}")
    for idx in range(STATS_RUNS):  # made before the window: the cost under test is STATS's
        _send(maker, protocol.encode(Command.HELLO, {"run_id": f"made-{os.getpid()}-{idx}",
                                                     "peer_id": f"made-{os.getpid()}-{idx}", "rank": 0}))
    socks = [_dealer(endpoints["frontend"], f"stats-{os.getpid()}-{c}") for c in range(2)]
    stats = protocol.encode(Command.STATS, {})
    while True:
        on.wait()
        for sock in socks:
            sent.value += _send(sock, stats)


def _hog(endpoints: dict[str, str], on, sent) -> None:
    tag = f"hog{os.getpid()}"
    socks = [_dealer(endpoints["frontend"], f"{tag}-c{c}") for c in range(HOG_CONNECTIONS)]
    beats = _dealer(endpoints["frontend"], f"{tag}-beats")
    peer_ids = [[f"{tag}-c{c}-p{p}" for p in range(HOG_PEERS)] for c in range(HOG_CONNECTIONS)]
    rounds, next_ask = 0, 0.0
    while True:
        on.wait()
        if time.monotonic() >= next_ask:
            for c, sock in enumerate(socks):
                for p, peer_id in enumerate(peer_ids[c]):
                    first = (rounds * HOG_PEERS + p) * HOG_SLOTS
                    sent.value += _send(sock, _request("hogged", peer_id, f"dst_{tag}c{c}_{os.getpid()}_1",
                                                       first, HOG_SLOTS))
            rounds += 1
            next_ask = time.monotonic() + 0.5
        for peer_id in (p for ids in peer_ids for p in ids):
            sent.value += _send(beats, protocol.encode(Command.HEARTBEAT, {"peer_id": peer_id, "role": "student"}))
        time.sleep(0.1)


def _runs(endpoints: dict[str, str], on, sent) -> None:
    sock = _dealer(endpoints["control"], f"runs-{os.getpid()}")
    seq = 0
    while True:
        on.wait()
        seq += 1
        sent.value += _send(sock, protocol.encode(Command.SET_MODEL, {
            "run_id": f"fake-{os.getpid()}-{seq}", "model_id": "m", "leader_epoch": 1,
            "peer_id": f"fake-{seq}", "leader_secret": "made-up"}))


_ATTACKERS = {"bodies": _bodies, "hellos": _hellos, "stats": _stats, "hog": _hog, "runs": _runs}


def run_attacker(parent_pid: int, ready, attack: str, endpoints: dict[str, str], on, sent) -> None:
    """A child process that runs ``attack`` while ``on`` is set, counting messages into ``sent``.

    At the lowest priority: on a machine of two cores an attacker that spins takes a core
    from the broker, the worker and the student whatever the broker does (a real one sends
    from its own machine); niced, it sends as fast as the idle CPU lets it, and the table
    shows what the broker's handling of its messages costs the good student."""
    child_init(parent_pid)
    os.nice(19)
    ready.set()
    _ATTACKERS[attack](endpoints, on, sent)
