"""What the broker knows of each peer, one record per peer, and the tables that hold them.

A peer id is bound to the connection it first spoke from (its ZeroMQ routing
identity) and, with CurveZMQ, to the public key that connection authenticated with.
A message naming a bound peer id from another connection is an impostor's (a DONE
that would settle another worker's slots, a BYE that would drop another student's
queue) and is refused; the binding ends when the peer leaves (BYE) or is declared
gone. Our peers set their routing identity to their peer id, so a reconnect (a TCP
blip) keeps the binding; ZeroMQ itself refuses a second live connection with an
identity already in use.

Mediums are owned the same way: the first student connection that asks for slots of
a medium owns it (with its stride) until its last peer leaves; REQUESTs of other
connections for it, or with another stride, are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distill.pipeline.broker.config import BrokerConfig
from distill.pipeline.broker.limits import over_limit
from distill.pipeline.protocol import ProtocolError

MAX_PURGED_REMEMBERED = 10_000
"""Ids of students declared gone, remembered to tell them RECONNECT when they beat again."""
MAX_ZOMBIE_WORKS = 10_000
"""In-flight works of purged workers remembered for their late DONE; beyond this the
oldest are forgotten (their students still free the slots when the process dies)."""


@dataclass(slots=True, eq=False)
class Connection:
    """One student connection (a frontend routing identity): what it has queued and owns."""

    identity: bytes
    key: str | None
    queued: int = 0
    """Slots of this connection in run queues."""
    mediums: dict[str, int] = field(default_factory=dict)
    """Medium name -> the stride its REQUESTs use."""
    peers: set[str] = field(default_factory=set)
    models: dict[str, str] = field(default_factory=dict)
    """Run id -> digest of the ``model_cfg`` a WELCOME sent this connection: sent once per model."""


@dataclass(slots=True, eq=False)
class SlotRequests:
    """Slots of one medium that a student wants filled (one REQUEST, or part of one)."""

    owner: Connection
    run_id: str
    medium: str
    stride: int
    slots: list[list[int]]
    """[[slot_idx, request_id], ...], as on the wire."""

    @property
    def student(self) -> bytes:
        return self.owner.identity


@dataclass(slots=True, eq=False)
class Work:
    work_id: int
    worker: bytes
    run_id: str
    generation: int
    requests: list[SlotRequests]
    num_slots: int
    parts: list[Work] = field(default_factory=list)
    """Fan-out: one part per run (each with its run's generation); empty for a one-run WORK."""
    credit: int | None = None
    """Credit spent, when not ``num_slots`` (a fan-out WORK spends one per sample computed)."""
    model_id: str | None = None
    sent_at: float = 0.0


@dataclass(slots=True, eq=False)
class WorkerPeer:
    identity: bytes
    peer_id: str
    key: str | None
    credit: int
    capacity: int
    """The credit of its last READY (capped): what returned credit may add up to."""
    max_batch: int
    last_seen: float
    in_flight: dict[int, Work] = field(default_factory=dict)
    process: str | None = None
    """The worker's process token (``liveness.process_token``), passed on in QUARANTINE."""
    direct: dict[str, tuple[int, int]] = field(default_factory=dict)
    """run -> (filled, failed) DIRECT slots the worker reported so far."""
    backlog: int = 0
    """DIRECT slots it reported taken and not yet answered (its last heartbeat): work we
    never see, counted against its credit when we pick a worker (``dispatch.py``)."""
    last_done_at: float = 0.0
    """When its last DONE came: the clock of its oldest in-flight WORK starts then, or at
    that WORK's sending, whichever is later (a worker does its WORKs in order)."""
    last_model: str | None = None
    """Model of its last DONE: a WORK of another model is its first batch of that model
    (``deadline.py``), and DIRECT work is timed against this one."""
    last_run: str | None = None
    """Run of its last DONE."""
    batches: int | None = None
    """Batches it says it has finished (its heartbeats; None: it does not say)."""
    progress_at: float = 0.0
    """When ``batches`` last moved (or a DONE came): a worker holding DIRECT slots whose
    count stands still past its deadline is stuck in its batch function."""
    backlog_since: float = 0.0
    """When its reported DIRECT ``backlog`` last went from none to some."""
    models: dict[str, str] = field(default_factory=dict)
    """Run id -> digest of the ``model_cfg`` a WORK sent this worker: WORK carries the
    config itself once per worker and model, its digest always (``runs.cfg_fields``)."""


@dataclass(slots=True, eq=False)
class StudentPeer:
    identity: bytes
    peer_id: str
    run_id: str
    last_seen: float
    connection: Connection


def medium_label(medium: str) -> str:
    """A medium's name as logs and refusals show it: a network medium's name carries the
    key of its data socket (``mediums/tcp.py``), which stays out of them."""
    if "://" not in medium:
        return medium[:64]
    parts = medium.split("/")
    return f"{parts[0]}//{parts[2][:64]}/.../{parts[-1][:64]}" if len(parts) > 4 else f"{parts[0]}//{parts[2][:64]}/..."


class Impostor(ProtocolError):
    """A message naming a peer id or medium bound to another connection (or key)."""


def check_key(what: str, bound: str | None, key: str | None) -> None:
    """Refuse a message whose CurveZMQ key is not the one ``what`` was bound with."""
    if bound != key:
        raise Impostor(f"{what} is bound to another CurveZMQ key: refused")


class StudentTable:
    """Students by peer id, their connections by routing identity, mediums by name."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.peers: dict[str, StudentPeer] = {}
        self.connections: dict[bytes, Connection] = {}
        self.mediums: dict[str, Connection] = {}
        self.purged: dict[str, None] = {}  # insertion-ordered set, bounded

    def __len__(self) -> int:
        return len(self.peers)

    def bound(self, identity: bytes, peer_id: str, key: str | None, command: str) -> StudentPeer | None:
        """The peer ``peer_id``, if known, after checking it is bound to this connection."""
        peer = self.peers.get(peer_id)
        if peer is not None and peer.identity != identity:
            raise Impostor(f"{command} names student {peer_id[:64]}, which is bound to another "
                                "connection: refused")
        if peer is not None:
            check_key(f"student {peer_id[:64]}", peer.connection.key, key)
        return peer

    def add(self, identity: bytes, peer_id: str, key: str | None, run_id: str, now: float) -> StudentPeer:
        if len(self.peers) >= self.config.max_students:
            raise over_limit(f"{len(self.peers)} students connected", "max_students")
        connection = self.connections.get(identity)
        if connection is None:
            connection = self.connections[identity] = Connection(identity, key)
        else:
            check_key("this connection", connection.key, key)
        peer = self.peers[peer_id] = StudentPeer(identity, peer_id, run_id, now, connection)
        connection.peers.add(peer_id)
        self.purged.pop(peer_id, None)
        return peer

    def remove(self, peer: StudentPeer, *, purged: bool = False) -> None:
        """Forget ``peer``; its connection (and the mediums it owns) once no peer is left on it."""
        del self.peers[peer.peer_id]
        if purged:
            self.purged[peer.peer_id] = None
            while len(self.purged) > MAX_PURGED_REMEMBERED:
                self.purged.pop(next(iter(self.purged)))
        connection = peer.connection
        connection.peers.discard(peer.peer_id)
        if not connection.peers:
            for medium in connection.mediums:
                if self.mediums.get(medium) is connection:
                    del self.mediums[medium]
            connection.mediums.clear()
            self.connections.pop(connection.identity, None)

    def claim_medium(self, connection: Connection, medium: str, stride: int) -> None:
        """Make ``connection`` the owner of ``medium`` (at ``stride``), or refuse."""
        owner = self.mediums.get(medium)
        if owner is connection:
            if connection.mediums[medium] != stride:
                raise ProtocolError(f"REQUEST.stride {stride} for medium {medium_label(medium)}, which this student "
                                    f"asked for with stride {connection.mediums[medium]}: refused")
            return
        if owner is not None:
            raise Impostor(f"medium {medium_label(medium)} belongs to another student connection: refused")
        if len(connection.mediums) >= self.config.max_mediums_per_student:
            raise over_limit(f"this student owns {len(connection.mediums)} mediums, cannot add "
                             f"{medium_label(medium)}", "max_mediums_per_student")
        self.mediums[medium] = connection
        connection.mediums[medium] = stride


class WorkerTable:
    """Workers by peer id, and the in-flight works of those declared gone."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.peers: dict[str, WorkerPeer] = {}
        self.zombies: dict[tuple[str, int], Work] = {}  # (worker peer_id, work_id), bounded

    def __len__(self) -> int:
        return len(self.peers)

    def bound(self, identity: bytes, peer_id: str, key: str | None, command: str) -> WorkerPeer | None:
        """The worker ``peer_id``, if known, after checking it is bound to this connection."""
        peer = self.peers.get(peer_id)
        if peer is not None and peer.identity != identity:
            raise Impostor(f"{command} names worker {peer_id[:64]}, which is bound to another "
                                "connection: refused")
        if peer is not None:
            check_key(f"worker {peer_id[:64]}", peer.key, key)
        return peer

    def add(self, identity: bytes, peer_id: str, key: str | None, now: float) -> WorkerPeer:
        if len(self.peers) >= self.config.max_workers:
            raise over_limit(f"{len(self.peers)} workers connected", "max_workers")
        peer = self.peers[peer_id] = WorkerPeer(identity, peer_id, key, 0, 0, 1, now, last_done_at=now)
        return peer

    def bury(self, peer: WorkerPeer) -> None:
        """Keep the in-flight works of a worker declared gone, for its late DONE."""
        for work in peer.in_flight.values():
            self.zombies[(peer.peer_id, work.work_id)] = work
        peer.in_flight.clear()
        while len(self.zombies) > MAX_ZOMBIE_WORKS:
            self.zombies.pop(next(iter(self.zombies)))

    def exhume(self, identity: bytes, peer_id: str, work_id: int) -> Work | None:
        """The buried work a late DONE is about (only from the connection it was sent to)."""
        work = self.zombies.get((peer_id, work_id))
        if work is None or work.worker != identity:
            return None
        return self.zombies.pop((peer_id, work_id))
