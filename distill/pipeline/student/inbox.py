"""A pool's way past the broker: its inbox for workers' notices, and DIRECT requests to
their lanes (docs/pipeline.md, sections Notices and Direct requests).

A pool with notices on has an :class:`Inbox`; one without (notices off, the network
medium, or an inbox that could not be bound) has a :class:`NoInbox`, which takes
nothing and sends nothing, so the pool's loop has no branch for either case.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from distill.pipeline.notices import NoticeInbox, encode_datagram
from distill.pipeline.protocol import Command, Message
from distill.pipeline.student.slots import SlotTable


class Inbox:
    """The inbox socket of one pool's segment, and (with ``direct``) the DIRECT requests
    sent from it to the lanes of the workers that filled our slots last."""

    def __init__(self, sock: NoticeInbox, segment: str, socket_dir: str | os.PathLike | None, *,
                 direct: bool) -> None:
        self._sock = sock
        self._segment = segment
        self._socket_dir = socket_dir
        self.direct = direct
        """Whether slots are asked of their lanes' workers (``PoolConfig.direct_requests``)."""

    @classmethod
    def open(cls, segment: str, socket_dir: str | os.PathLike | None, *, direct: bool) -> Inbox | NoInbox:
        """The inbox of ``segment`` in ``socket_dir``, or a :class:`NoInbox` when it cannot be bound."""
        sock = NoticeInbox.open(segment, socket_dir)
        return NoInbox() if sock is None else cls(sock, segment, socket_dir, direct=direct)

    @property
    def path(self) -> Path:
        return self._sock.path

    def fileno(self) -> int | None:
        return self._sock.fileno()

    def present(self) -> bool:
        """Whether its file is still there (workers find it by name)."""
        return self._sock.present()

    def receive(self) -> list[Message]:
        """The notices and DECLINEDs waiting (malformed datagrams dropped)."""
        return self._sock.receive()

    def rebind(self) -> Inbox | NoInbox:
        """After its file vanished: this inbox closed, a new one bound in its place (or a
        :class:`NoInbox` when that fails: notices go through the broker from then on)."""
        self._sock.close()
        return Inbox.open(self._segment, self._socket_dir, direct=self.direct)

    def send_direct(self, table: SlotTable, slots: list[int], share: Callable[[], int], body: dict) -> tuple[list[int], dict[str, int]]:
        """Ask for the slots that have a lane straight from its worker, up to ``share()`` of
        our slots per worker (a lane is sticky: without a cap, one worker would end up
        holding them all). ``body`` is the request's fields but its slots. Returns the
        slots left for the broker (no lane, over the share, or the datagram was not
        taken) and how many were asked of each worker (by process token)."""
        if not self.direct or all(table.records[slot].lane is None for slot in slots):
            return slots, {}
        records = table.records
        held = table.direct_held()
        most = share()
        by_lane: dict[tuple[str, str], list[int]] = {}
        rest = []
        for slot in slots:
            lane = records[slot].lane
            if lane is None or held.get(lane[1], 0) >= most:
                rest.append(slot)
                continue
            held[lane[1]] = held.get(lane[1], 0) + 1
            by_lane.setdefault(lane, []).append(slot)
        asked: dict[str, int] = {}
        for (path, process), group in by_lane.items():
            data = encode_datagram(Command.DIRECT, {**body, "slots": [[s, records[s].request_id] for s in group]})
            if self._sock.send_to(path, data):
                for slot in group:
                    table.asked_directly(records[slot], process)
                asked[process] = asked.get(process, 0) + len(group)
                continue
            # gone or full: nobody will write these, the broker may
            table.set_lanes([records[slot] for slot in group], None)
            rest.extend(group)
        return rest, asked

    def close(self) -> None:
        self._sock.close()


class NoInbox:
    """A pool without an inbox: no notices come, every request goes through the broker."""

    direct = False
    path = None

    def fileno(self) -> None:
        return None

    def present(self) -> bool:
        return True

    def receive(self) -> list[Message]:
        return []

    def rebind(self) -> NoInbox:
        return self

    def send_direct(self, table: SlotTable, slots: list[int], share: Callable[[], int], body: dict) -> tuple[list[int], dict[str, int]]:
        return slots, {}

    def close(self) -> None:
        pass
