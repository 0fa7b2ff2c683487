"""Fuzzing with random and mutated messages (see tests/mutants.py).

Every broker socket, and a real worker behind a fake broker, get tens of thousands
of almost-valid messages in bursts. Afterwards they must still be alive, serve a
normal run with exact samples, not have grown in memory between the first and the
second half of the fuzzing, and (the worker) have written nothing outside the slots
it was given and mapped nothing that is not ours. The seed is printed (and can be
set with DISTILL_FUZZ_SEED) so a failure can be replayed.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import errno
import fcntl
import logging
import multiprocessing as mp
import os
import random
import socket
import time
from collections.abc import Iterator

import msgpack
import pytest
import torch
import zmq

from distill.modes.stats import fetch_stats
from distill.pipeline import Broker, StudentClient, Worker, protocol
from distill.pipeline.broker.control import MAX_CLAIMED_GENERATION
from distill.pipeline.mediums.shm import SharedMemoryManager
from distill.pipeline.notices import lane_path
from distill.pipeline.protocol import PROTOCOL_TAG, Command, ProtocolError
from distill.pipeline.slot import HEADER_BYTES, HeaderTable, check_slot, slot_stride
from tests import peers
from tests.fakes import FakeBroker
from tests.hostile import LEADER_SECRET, deep_map, raw_body, request, set_model
from tests.mutants import Mutator, Targets
from tests.procfs import rss_bytes, shm_mappings, steady_growth

log = logging.getLogger(__name__)

MESSAGES_PER_ROUND = 10_000
"""Per broker socket (3 of them), and to the worker, in each round."""
BURST = 250
"""Messages sent before the replies are drained (no waiting for each reply)."""
WARM_UP_ROUNDS = 2
"""Rounds that fill allocator pools and the peer tables up to their caps: not measured."""
MEASURED_ROUNDS = 5
"""Rounds whose RSS steps are compared: a median over 5 steps ignores up to 2 jumps."""
MAX_GROWTH_PER_ROUND = 8 * 2**20
"""Median RSS step the broker or the worker may take per measured round (see ``steady_growth``)."""
SLOT_COUNT = 8
MARKER_WORK_ID = 2**62 + 12_345
"""Work ids of the test's own WORKs (the fuzzer's are small or at the edges)."""


@pytest.fixture
def seed() -> int:
    value = int(os.environ.get("DISTILL_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
    print(f"fuzz seed {value} (replay: DISTILL_FUZZ_SEED={value})")
    return value


# --------------------------------------------------------------------------- broker
BROKER_COMMANDS = {
    "frontend": [Command.HELLO, Command.REQUEST, Command.HEARTBEAT, Command.STATS, Command.BYE],
    "backend": [Command.READY, Command.DONE, Command.HEARTBEAT, Command.BYE, Command.ERROR],
    "control": [Command.SET_MODEL, Command.STATS, Command.STOP],
}


def _stops_all_workers(frames: list[bytes]) -> bool:
    """A well-formed STOP for every run (a leader's right, not bad input: skipped)."""
    try:
        msg = protocol.decode(frames)
    except ProtocolError:
        return False
    return msg.command is Command.STOP and msg.body.get("run_id") is None


@pytest.mark.timeout(240)
def test_broker_survives_fuzzing_on_every_socket(seed, procs, endpoints) -> None:
    broker = procs.start(peers.run_broker, endpoints, name="broker")
    worker = procs.start(peers.run_worker, endpoints, name="worker")
    ctx = zmq.Context.instance()
    socks = {name: [_dealer(ctx, endpoints[name]) for _ in range(2)] for name in BROKER_COMMANDS}
    targets = Targets(mediums=["dst_fuzz_1_1"], stride=slot_stride(peers.batch_config().nbytes()))
    mutators = {name: Mutator(seed + i, targets, commands)
                for i, (name, commands) in enumerate(BROKER_COMMANDS.items())}
    try:
        rss = []
        for _ in range(WARM_UP_ROUNDS + MEASURED_ROUNDS):
            started = time.monotonic()
            _fuzz_broker_round(socks, mutators, broker, seed)
            log.info("broker round took %.1fs", time.monotonic() - started)
            assert broker.is_alive(), f"broker died (exit code {broker.exitcode}); seed {seed}"
            rss.append(rss_bytes(broker.pid))
            stats = fetch_stats(endpoints["frontend"])
            log.info("broker after the round: %s", {k: v for k, v in stats.items() if k != "per_run"})
        log.info("broker RSS after each round: %s", rss)
        # A leak of ~280 bytes per message adds 8 MiB in each round of 30,000 messages.
        growth = steady_growth(rss[WARM_UP_ROUNDS - 1:])
        assert growth < MAX_GROWTH_PER_ROUND, f"broker grew {growth / 2**20:.1f} MiB a round: {rss} (seed {seed})"
        _normal_run(endpoints)
        assert broker.is_alive() and worker.is_alive()
    finally:
        for dealers in socks.values():
            for sock in dealers:
                sock.close(0)


def _dealer(ctx: zmq.Context, endpoint: str, identity: str | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.ROUTING_ID, identity.encode())
    sock.connect(endpoint)
    return sock


def _fuzz_broker_round(socks: dict[str, list[zmq.Socket]], mutators: dict[str, Mutator],
                       broker: mp.Process, seed: int) -> None:
    for i in range(MESSAGES_PER_ROUND):
        for name, dealers in socks.items():
            frames = mutators[name].message() or [b""]
            if name == "control" and _stops_all_workers(frames):
                frames = [b"not a stop"]
            _send(dealers[i % 2], frames, broker, seed)
        if i % BURST == BURST - 1:
            for dealers in socks.values():
                _drain_all(dealers)
    _sync_broker(socks)


def _send(sock: zmq.Socket, frames: list[bytes], peer: mp.Process, seed: int) -> None:
    """Send without blocking for ever: a full queue is waited out while ``peer`` lives."""
    while True:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
            return
        except zmq.Again:
            assert peer.is_alive(), f"{peer.name} died (exit code {peer.exitcode}); seed {seed}"
            _drain_all([sock])
            sock.poll(100, zmq.POLLOUT)


def _drain_all(dealers: list[zmq.Socket]) -> int:
    count = 0
    for sock in dealers:
        while True:
            try:
                sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            count += 1
    return count


def _sync_broker(socks: dict[str, list[zmq.Socket]], timeout_s: float = 60) -> None:
    """Wait until the broker answered a marker sent after the round on every socket
    (it serves each connection in order, so the round before it is processed)."""
    markers = {"frontend": (Command.STATS, {}), "control": (Command.STATS, {}),
               "backend": (Command.HEARTBEAT, {"peer_id": "sync-marker", "role": "worker"})}
    expect = {"frontend": Command.STATS_REPLY, "control": Command.STATS_REPLY, "backend": Command.RECONNECT}
    for name, dealers in socks.items():
        _drain_all(dealers)
        sock = dealers[0]
        protocol.send(sock, *markers[name])
        deadline, answered = time.monotonic() + timeout_s, False
        while sock.poll(200 if answered else max(0.0, deadline - time.monotonic()) * 1000):
            with contextlib.suppress(ProtocolError):
                answered |= protocol.recv(sock).command is expect[name]
        assert answered, f"{name}: no answer to the marker in {timeout_s}s"
        _drain_all(dealers)


def _normal_run(endpoints: dict[str, str], samples: int = 40) -> None:
    """A run the fuzzer never named: exact samples, through the fuzzed broker and worker."""
    with StudentClient(0, 4, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"], run_id="final", heartbeat_interval_s=0.2) as client:
        client.hello()
        generation = client.set_model("m")
        for _ in range(samples):
            ref = client.request_sample(timeout_ms=20_000)
            assert ref is not None, "no sample after the fuzzing"
            assert ref.generation == generation
            assert torch.equal(ref.tensors["x"], peers.expected_x(ref.request_id, generation))
            client.release_slot(ref.slot_id)


# --------------------------------------------------------------------------- hostile shapes (issue 21)
HOSTILE_ROUNDS = 2
HOSTILE_PER_ROUND = 250
HUGE_COUNTS = [100_000, 2**40, 2**62, 2**63 - 1]


def _hostile_message(rng: random.Random, own: str, other: str, other_medium: str) -> tuple[str, list[bytes]]:
    """One well-formed message whose content is hostile: huge counts, deep or huge
    model_cfg, another connection's peer id or medium, slots and strides past the caps.
    ``own``/``other``: the peer ids of this connection and of the other one."""
    shape = rng.randrange(10)
    huge = rng.choice(HUGE_COUNTS)
    if shape == 0:
        return "backend", protocol.encode(Command.READY, {"peer_id": own, "credit": huge, "max_batch": huge})
    if shape == 1:
        return "backend", protocol.encode(Command.DONE, {"peer_id": rng.choice([own, other]), "num_items": huge,
                                                         "work_id": rng.randrange(1, 64), "failed": []})
    if shape == 2:
        depth = rng.choice([33, 100, 1000])
        return "control", [PROTOCOL_TAG, Command.SET_MODEL.value, raw_body(
            set_model(run_id=rng.choice(["fan-a", "fan-b"]), share_model=True), {"model_cfg": deep_map(depth)})]
    if shape == 3:
        cfg = rng.choice([{"x": list(range(20_000))}, {"x": "y" * 100_000}, {f"k{i}": i for i in range(9000)}])
        return "control", protocol.encode(Command.SET_MODEL, set_model(run_id="fan-a", model_cfg=cfg)) \
            if _encodable(cfg) else [PROTOCOL_TAG, Command.SET_MODEL.value,
                                    raw_body(set_model(run_id="fan-a"), {"model_cfg": msgpack.packb(cfg)})]
    if shape == 4:
        return "frontend", protocol.encode(Command.REQUEST, request(own, other_medium, [[0, rng.randrange(2**40)]]))
    if shape == 5:
        slot_idx, stride = rng.choice([(2**40, 4160), (0, 2**62), (2**20, 4160), (1, 65), (0, 2**63 - 1)])
        return "frontend", protocol.encode(Command.REQUEST, request(own, f"dst_hostile_{own[-1]}_1",
                                                                    [[slot_idx, rng.randrange(2**40)]], stride=stride))
    if shape == 6:
        command = rng.choice([Command.HELLO, Command.BYE])
        body = {"peer_id": other} | ({"run_id": "default"} if command is Command.HELLO else {})
        return "frontend", protocol.encode(command, body)
    if shape == 7:
        return "backend", protocol.encode(Command.BYE, {"peer_id": other})
    if shape == 9:  # slots in the fan-out runs whose model_cfg is hostile: dispatch compares them
        run_id = rng.choice(["fan-a", "fan-b"])
        return "frontend", protocol.encode(Command.REQUEST, request(
            f"{own}-{run_id}", f"dst_hostile_{own[-1]}{run_id[-1]}_1", [[rng.randrange(64), rng.randrange(2**40)]],
            run_id=run_id))
    many = 65536 if rng.random() < 0.05 else 8192  # (the broker takes large messages at 10% of its time)
    return "frontend", protocol.encode(Command.REQUEST, request(own, f"dst_hostile_{own[-1]}_1",
                                                                [[i % 1024, rng.randrange(2**40)] for i in range(many)]))


def _encodable(cfg: dict) -> bool:
    try:
        protocol.encode(Command.SET_MODEL, set_model(model_cfg=cfg))
    except ProtocolError:
        return False
    return True


@pytest.mark.timeout(120)
def test_broker_survives_hostile_shapes_from_two_connections(seed, procs, endpoints) -> None:
    """Each of two connections per socket registers a peer id and a medium, then sends
    well-formed hostile messages naming its own and the other's: the broker refuses or caps
    every one (no handler raises: STATS errors stays 0), stays within its memory, and
    serves a normal run exactly afterwards."""
    broker = procs.start(peers.run_broker, endpoints, name="broker")
    procs.start(peers.run_worker, endpoints, name="worker")
    rng = random.Random(seed)
    ids = ["hostile-a", "hostile-b"]
    socks = {name: [_dealer(zmq.Context.instance(), endpoints[name], identity) for identity in ids]
             for name in BROKER_COMMANDS}
    try:
        for i, own in enumerate(ids):  # each binds its ids and its medium first
            protocol.send(socks["frontend"][i], Command.REQUEST, request(own, f"dst_hostile_{own[-1]}_1", [[0, 1]]))
            protocol.send(socks["backend"][i], Command.READY, {"peer_id": own, "credit": 4, "max_batch": 2})
        rss = []
        for _ in range(HOSTILE_ROUNDS):
            for n in range(HOSTILE_PER_ROUND):
                i = rng.randrange(2)
                name, frames = _hostile_message(rng, ids[i], ids[1 - i], f"dst_hostile_{ids[1 - i][-1]}_1")
                _send(socks[name][i], frames, broker, seed)
                if n % BURST == BURST - 1:
                    for dealers in socks.values():
                        _drain_all(dealers)
            _sync_broker(socks)
            assert broker.is_alive(), f"broker died (exit code {broker.exitcode}); seed {seed}"
            rss.append(rss_bytes(broker.pid))
        stats = fetch_stats(endpoints["frontend"])
        assert stats["errors"] == 0, f"a handler raised on a hostile message (seed {seed}): {stats}"
        assert stats["foreign"] > 0 and stats["bad_messages"] > 0, stats
        assert max(rss) - rss[0] < 64 * 2**20, f"broker grew {rss} (seed {seed})"
        _normal_run(endpoints)
        assert broker.is_alive()
    finally:
        for dealers in socks.values():
            for sock in dealers:
                sock.close(0)


# --------------------------------------------------------------------------- worker
@contextlib.contextmanager
def _foreign_segments(size: int) -> Iterator[list[str]]:
    """Real segments a worker must refuse: a foreign name, and one of our form that is
    not private to the user (held locked, so no sweep takes it for an orphan)."""
    names = [f"psm_fuzz{os.getpid()}", f"dst_fuzz_{os.getpid()}_999999"]
    fds = []
    try:
        for name, mode in zip(names, (0o600, 0o644), strict=True):
            fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=mode)
            fds.append(fd)
            os.fchmod(fd, mode)
            os.ftruncate(fd, size)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield names
    finally:
        for name, fd in zip(names, fds, strict=False):
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                _posixshmem.shm_unlink("/" + name)


def _allowed_writes(frames: list[bytes], medium: str, size: int, payload_bytes: int,
                    allowed: bytearray) -> None:
    """Mark the header + payload of every slot of ``medium`` that a decodable WORK
    names in bounds: the only bytes the worker may ever write."""
    try:
        msg = protocol.decode(frames)
    except ProtocolError:
        return
    if msg.command is not Command.WORK:
        return
    for name, slot_idx, stride, _ in msg.body["items"]:
        start = slot_idx * stride
        if name == medium and stride >= HEADER_BYTES + payload_bytes and start + stride <= size:
            allowed[start:start + HEADER_BYTES + payload_bytes] = b"\x01" * (HEADER_BYTES + payload_bytes)


@pytest.mark.timeout(240)
def test_worker_survives_fuzzing_and_writes_only_inside_given_slots(seed, procs, endpoints) -> None:
    config = peers.batch_config()
    stride = slot_stride(config.nbytes())
    size = SLOT_COUNT * stride
    fake = FakeBroker(endpoints, record=lambda work_id: work_id >= MARKER_WORK_ID)
    worker = procs.start(peers.run_worker, endpoints, name="worker")
    with SharedMemoryManager(slot_count=SLOT_COUNT, slot_stride=stride) as shm, \
            _foreign_segments(size) as foreign:
        canary = random.Random(seed).randbytes(size)
        shm.buf[:size] = canary
        allowed = bytearray(size)
        targets = Targets(mediums=[shm.buf_name], foreign_mediums=foreign, stride=stride,
                          slot_count=SLOT_COUNT)
        mutator = Mutator(seed, targets, [Command.WORK])
        broadcasts = Mutator(seed + 1, targets, [Command.MODEL, Command.STOP])
        try:
            fake.wait_ready()
            rss = []
            for round_idx in range(WARM_UP_ROUNDS + MEASURED_ROUNDS):  # measured as the broker's
                marker = MARKER_WORK_ID + round_idx
                _fuzz_worker_round(fake, mutator, broadcasts, shm.buf_name, size, config.nbytes(), allowed,
                                   marker)
                fake.wait_done(marker)
                assert worker.is_alive(), f"worker died (exit code {worker.exitcode}); seed {seed}"
                rss.append(rss_bytes(worker.pid))
                mapped = shm_mappings(worker.pid)
                assert not mapped & set(foreign), f"worker mapped {mapped & set(foreign)} (seed {seed})"
            log.info("worker RSS after each round: %s", rss)
            # Like the broker's, the worker's RSS can jump by ~10 MiB (a buffer the
            # allocator keeps); a leak of ~800 bytes per message adds 8 MiB a round.
            growth = steady_growth(rss[WARM_UP_ROUNDS - 1:])
            assert growth < MAX_GROWTH_PER_ROUND, \
                f"worker grew {growth / 2**20:.1f} MiB a round: {rss} (seed {seed})"
            outside = [i for i in range(size) if not allowed[i] and shm.buf[i] != canary[i]]
            assert not outside, f"worker wrote {len(outside)} bytes outside given slots, first at {outside[0]}"
            _worker_normal_run(fake, shm, config.nbytes(), stride)
            assert worker.is_alive()
        finally:
            fake.close()


def _fuzz_worker_round(fake: FakeBroker, mutator: Mutator, broadcasts: Mutator, medium: str, size: int,
                       payload_bytes: int, allowed: bytearray, marker: int) -> None:
    """Send a round of fuzz, then a WORK ``marker`` whose DONE says the round is processed."""
    for i in range(MESSAGES_PER_ROUND):
        frames = mutator.message() or [b""]
        _allowed_writes(frames, medium, size, payload_bytes, allowed)
        fake.router.send_multipart([fake.identity, *frames])
        if i % 10 == 0:  # broadcasts too, but never a STOP for all
            frames = broadcasts.message() or [b""]
            if not _stops_all_workers(frames):
                fake.pub.send_multipart([broadcasts.rng.choice([b"", b"fuzz", b"\xff" * 300]), *frames])
        if i % BURST == BURST - 1:
            fake.drain()
    protocol.send(fake.router, Command.WORK, {"work_id": marker, "run_id": "marker", "generation": 0,
                                              "model_id": "m", "items": []}, identity=fake.identity)


def _worker_normal_run(fake: FakeBroker, shm: SharedMemoryManager, payload_bytes: int, stride: int) -> None:
    items = [[shm.buf_name, slot_idx, stride, 1000 + slot_idx] for slot_idx in range(SLOT_COUNT)]
    HeaderTable(shm.buf, stride).ask(list(range(SLOT_COUNT)), [1000 + slot_idx for slot_idx in range(SLOT_COUNT)])
    protocol.send(fake.router, Command.WORK, {"work_id": MARKER_WORK_ID + 100, "run_id": "final", "generation": 1,
                                              "model_id": "m", "items": items}, identity=fake.identity)
    assert fake.wait_done(MARKER_WORK_ID + 100) == []
    for slot_idx in range(SLOT_COUNT):
        view = shm.slot_view(slot_idx)
        assert check_slot(view, 1, 1000 + slot_idx, payload_bytes) is None
        x = torch.frombuffer(view[HEADER_BYTES:HEADER_BYTES + peers.PAYLOAD_FLOATS * 4], dtype=torch.float32)
        assert torch.equal(x, peers.expected_x(1000 + slot_idx, 1))


# --------------------------------------------------------------------------- a worker's request lane
LANE_DATAGRAMS = 2_000


@pytest.mark.timeout(120)
def test_a_worker_survives_fuzzing_on_its_request_lane(seed, endpoints, broker_kwargs) -> None:
    """Mutated DIRECT requests and garbage on a live worker's lane (aimed at a decoy
    segment, a missing one and foreign names) while a real student is served through
    the same lane: the worker keeps filling, and every sample the student gets is exact."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    worker = Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(), max_batch=4,
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
                    heartbeat_interval_s=0.2).start()
    stride = slot_stride(peers.batch_config().nbytes())
    decoy = SharedMemoryManager(4, stride, run_id="decoy")
    mutator = Mutator(seed, Targets(mediums=[decoy.buf_name, "dst_nobody_1_1"], stride=stride), [Command.DIRECT])
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.settimeout(1.0)  # a full lane queue: wait for the worker to read
    try:
        client = StudentClient(0, 8, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                               endpoints["control_pub"], heartbeat_interval_s=0.2)
        with client:
            client.hello()
            generation = client.set_model("fuzzed-lane")
            seen = peers.consume_verified(client, generation, 50)
            lane = os.fspath(lane_path(worker.peer_id))
            for i in range(LANE_DATAGRAMS):
                frames = mutator.message()
                datagram = (mutator.rng.randbytes(mutator.rng.randrange(64)) if i % 10 == 0
                            else msgpack.packb(frames, use_bin_type=True))
                _send_datagram(sender, datagram, lane)
                if i % 100 == 0:
                    seen = peers.consume_verified(client, generation, len(seen) + 10, seen=seen)
            peers.consume_verified(client, generation, len(seen) + 200, seen=seen)
            assert client._pool.counts["direct"] > 0
        assert worker._thread.is_alive()
    finally:
        sender.close()
        worker.stop()
        broker.stop()
        decoy.close()


# --------------------------------------------------------------------------- regressions found by fuzzing
@pytest.mark.timeout(60)
def test_set_model_past_the_largest_generation_is_refused_and_the_broker_keeps_serving(
        endpoints, broker_kwargs) -> None:
    """A SET_MODEL that restored generation 2**63-1 used to make the next switch's
    generation unencodable: the broker thread died on its next WORK."""
    broker = Broker(**broker_kwargs).start()
    worker = Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(),
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"]).start()
    control = _dealer(zmq.Context.instance(), endpoints["control"])
    try:
        def set_model(restore: int | None) -> protocol.Message:
            protocol.send(control, Command.SET_MODEL, {"run_id": "default", "model_id": "m",
                                                       "restore_generation": restore, "leader_epoch": 1,
                                                       "peer_id": "leader", "leader_secret": LEADER_SECRET})
            assert control.poll(5000)
            return protocol.recv(control)

        assert "maximum" in set_model(protocol.MAX_INT).body["reason"]
        # A claim is bounded far below the maximum (control.MAX_CLAIMED_GENERATION), and a
        # led run's generation moves by one step: no message brings it near the maximum.
        assert "at most" in set_model(protocol.MAX_INT - 1).body["reason"]
        assert set_model(MAX_CLAIMED_GENERATION).body["generation"] == MAX_CLAIMED_GENERATION
        assert set_model(None).body["generation"] == MAX_CLAIMED_GENERATION + 1
        refused = set_model(protocol.MAX_INT - 1)
        assert refused.command is Command.ERROR and "jumps past" in refused.body["reason"]
        assert broker.stats.per_run["default"]["generation"] == MAX_CLAIMED_GENERATION + 1
        _normal_run(endpoints)
    finally:
        control.close(0)
        worker.stop()
        broker.stop()


# --------------------------------------------------------------------------- datagrams and generations (issue 21)
def _send_datagram(sender: socket.socket, datagram: bytes, path: str) -> None:
    """Send without waiting: a full inbox drops it, and so does the kernel one larger than
    a datagram may be (EMSGSIZE: a mutant can grow past it; the student never sees it)."""
    try:
        sender.sendto(datagram, path)
    except (BlockingIOError, TimeoutError):
        pass
    except OSError as exc:
        if exc.errno != errno.EMSGSIZE:
            raise


INBOX_DATAGRAMS = 3_000
WILD_GENERATIONS = [2**62, 2**63 - 1, 2**63 - 2, 2**32, 0]


@pytest.mark.timeout(120)
def test_a_student_survives_fuzzed_datagrams_and_no_generation_moves(seed, procs, endpoints) -> None:
    """Mutated COMPLETE and DECLINED datagrams (wild generations, the student's own slots
    and pending request ids, foreign slots, garbage) at a live student's inbox while it is
    served: its generation never moves, every sample it yields is exact and yielded
    once, its slots stay consistent, and a switch afterwards is the next generation."""
    procs.start(peers.run_broker, endpoints, name="broker")
    procs.start(peers.run_worker, endpoints, name="worker")
    rng = random.Random(seed)
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.setblocking(False)  # a full inbox drops the datagram: the student reads between samples
    try:
        with StudentClient(0, 8, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], heartbeat_interval_s=0.2) as client:
            client.hello()
            generation = client.set_model("fuzzed-inbox")
            seen = peers.consume_verified(client, generation, 20)
            pool = client._pool
            mutator = Mutator(seed, Targets(slot_count=8), [Command.COMPLETE, Command.DECLINED])
            inbox = os.fspath(pool._inbox.path)
            for i in range(INBOX_DATAGRAMS):
                frames = mutator.message()
                msg = _decodable(frames)
                aimable = msg is not None and msg.command in (Command.COMPLETE, Command.DECLINED)
                if aimable and rng.random() < 0.5:  # aim at what the student waits for
                    pending = [[r.idx, r.request_id] for r in pool.slots.records if r.request_id]
                    body = dict(msg.body, generation=rng.choice(WILD_GENERATIONS + [generation]))
                    if pending:
                        body["slots"] = [row + ([True] if msg.command is Command.COMPLETE else [])
                                         for row in rng.sample(pending, rng.randint(1, len(pending)))]
                    frames = protocol.encode(msg.command, body)
                datagram = (rng.randbytes(rng.randrange(64)) if i % 10 == 0
                            else msgpack.packb(frames, use_bin_type=True))
                _send_datagram(sender, datagram, inbox)
                if i % 8 == 0:  # the inbox holds about 10 datagrams: let the student read them
                    seen = peers.consume_verified(client, generation, len(seen) + 1, seen=seen)
                    assert client.generation == generation, f"a datagram moved the generation (seed {seed})"
            peers.consume_verified(client, generation, len(seen) + 100, seen=seen)
            assert client.generation == generation
            assert not pool.slots.check(), pool.slots.check()
            assert client.set_model("after") == generation + 1
    finally:
        sender.close()


def _decodable(frames: list[bytes]) -> protocol.Message | None:
    try:
        return protocol.decode(frames)
    except ProtocolError:
        return None


GEOMETRY_ROUNDS = 2_000
FILL = 17
"""The request id every slot of the target segment waits for (one the mutator uses):
only the geometry stands between a fuzzed item and the slot."""


@pytest.mark.timeout(120)
def test_a_worker_writes_only_at_the_geometry_its_segment_declares(seed, procs, endpoints) -> None:
    """WORK of fuzzed strides and slot indices, aimed at a real segment whose every slot
    waits for the fill the items name (so a claim would pass): the worker writes only
    the slots the segment's own header describes, at its stride."""
    config = peers.batch_config()
    stride = slot_stride(config.nbytes())
    fake = FakeBroker(endpoints, record=lambda work_id: work_id >= MARKER_WORK_ID)
    procs.start(peers.run_worker, endpoints, name="worker")
    rng = random.Random(seed)
    with SharedMemoryManager(SLOT_COUNT, stride, run_id="geom", payload_bytes=config.nbytes()) as shm:
        size = SLOT_COUNT * stride
        table = HeaderTable(shm.buf, stride)
        try:
            fake.wait_ready()
            for round_idx in range(GEOMETRY_ROUNDS // 100):
                canary = rng.randbytes(size)
                shm.buf[:size] = canary
                table.ask(list(range(SLOT_COUNT)), [FILL] * SLOT_COUNT)
                before = bytes(shm.buf)
                allowed = bytearray(size)
                items = []
                for _ in range(100):
                    slot_idx = rng.choice([0, 1, SLOT_COUNT - 1, SLOT_COUNT, 2**31, rng.randrange(SLOT_COUNT)])
                    item_stride = rng.choice([stride, stride + 64, stride - 64, 2 * stride, stride * SLOT_COUNT,
                                              64, 2**40])
                    items.append([shm.buf_name, slot_idx, item_stride, FILL])
                    if item_stride == stride and slot_idx < SLOT_COUNT:
                        start = slot_idx * stride
                        allowed[start:start + HEADER_BYTES + config.nbytes()] = b"\x01" * (HEADER_BYTES + config.nbytes())
                fake.work(MARKER_WORK_ID + round_idx, items, generation=1)
                fake.wait_done(MARKER_WORK_ID + round_idx)
                after = bytes(shm.buf)
                outside = [i for i in range(size) if not allowed[i] and after[i] != before[i]]
                assert not outside, f"wrote {len(outside)} bytes outside the declared geometry (seed {seed})"
        finally:
            fake.close()
