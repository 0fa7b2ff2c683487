"""The pool's decisions (``delivery.py``, ``custody.py``) over a bare slot table and a
bytearray of slots: no pool, no broker, no sockets. Each test plays the writers (claims
and commits in the headers, as ``worker/claims.py`` and ``worker/commit.py`` write them)
and checks what the decision moved in the table and what it left for the pool to carry
out (``to_ask``: headers to ask; ``to_send``: requests to send)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

from distill.pipeline.liveness import new_writer_id, process_token
from distill.pipeline.slot import HeaderTable, slot_stride
from distill.pipeline.student.custody import Custody
from distill.pipeline.student.delivery import Delivery, SlotAccess
from distill.pipeline.student.slots import FREE, PENDING, QUARANTINED, READY, Route, SlotTable

PAYLOAD = 16
GONE_WRITER = (2**31 - 2) << 32 | 1
"""A writer id whose process does not run (no such pid)."""


def _parts(count: int = 4) -> tuple[SlotAccess, Delivery, Custody]:
    stride = slot_stride(PAYLOAD)
    buf = memoryview(bytearray(stride * count))
    access = SlotAccess(SlotTable(count), HeaderTable(buf, stride), lambda slot: buf[slot * stride:(slot + 1) * stride],
                        PAYLOAD, "test", Counter())
    delivery = Delivery(access)
    heart = SimpleNamespace(interval_s=0.1, liveness=3, workers=1)
    return access, delivery, Custody(access, delivery, heart, pending_deadline_s=1.0)  # type: ignore[arg-type]


def _carry_out(access: SlotAccess) -> None:
    """The pool's part after every decision: ask the headers of the slots given new requests."""
    table = access.table
    access.headers.ask(table.to_ask, [table.records[slot].request_id for slot in table.to_ask])
    table.to_ask.clear()


def _ask(access: SlotAccess, slots: list[int]) -> list[int]:
    """Ask for the slots from FREE, as the pool does; their request ids, sent."""
    access.table.ask(slots, 0.0, from_free=True)
    _carry_out(access)
    access.table.to_send.clear()
    return [access.table.records[slot].request_id for slot in slots]


def _commit(access: SlotAccess, slot: int, req: int, writer: int, generation: int = 1) -> None:
    access.headers.set_claims([slot], writer)
    access.headers.write([slot], generation, [req], PAYLOAD, writer=writer)


def test_a_committed_fill_is_accepted_once() -> None:
    access, delivery, _ = _parts()
    (req,) = _ask(access, [0])
    writer = new_writer_id()
    _commit(access, 0, req, writer)
    delivery.on_complete(1, [[0, req, True]])
    record = access.table.records[0]
    assert record.state is READY and record.writer == writer and delivery.writers.keys() == {writer}
    delivery.on_complete(1, [[0, req, True]])  # again: not pending any more
    assert access.counts == {"accepted": 1, "rejected": 1}
    assert access.table.check() == [] and not access.table.to_send


def test_a_live_writer_that_has_not_committed_keeps_the_slot() -> None:
    access, delivery, _ = _parts()
    (req,) = _ask(access, [0])
    writer = new_writer_id()
    access.headers.set_claims([0], writer)  # claimed, still writing
    delivery.on_complete(1, [[0, req, True]])
    record = access.table.records[0]
    assert record.state is PENDING and (record.route, record.holder) == (Route.WRITER, writer)
    assert not access.table.to_send and not access.table.to_ask  # nobody else is asked
    assert access.table.check() == []


def test_a_wrong_commit_is_refused_and_asked_for_with_a_new_request() -> None:
    access, delivery, _ = _parts()
    (req,) = _ask(access, [0])
    _commit(access, 0, req ^ 2, GONE_WRITER)  # another fill's commit, by a writer that is gone
    delivery.on_complete(1, [[0, req, True]])
    record = access.table.records[0]
    assert record.state is PENDING and record.request_id != req and not access.table.reissue
    assert access.table.to_send == [0] and access.table.to_ask == [0]  # the pool asks its header, then sends
    _carry_out(access)
    assert access.headers.claims([0]) == ([0], [record.request_id])  # the old writer finds another fill
    assert access.counts["rejected"] == 1 and access.table.check() == []


def test_quarantine_takes_claimed_slots_out_and_reissues_their_requests_at_once() -> None:
    access, _, custody = _parts(4)
    live = new_writer_id()
    a, b = _ask(access, [0, 1])
    access.headers.set_claims([0], live)  # slot 0 is being written; slot 1 nobody claims
    custody.on_quarantine([[0, a], [1, b]], process=process_token())  # a worker on this machine
    table = access.table
    assert table.records[0].state is QUARANTINED and table.records[0].holder == live
    renewed = table.records[1]
    assert renewed.state is PENDING and renewed.request_id not in (a, b)
    # both requests are asked for again at once, in the FREE slots 2 and 3
    assert {table.records[2].request_id, table.records[3].request_id} == {a, b}
    assert table.records[2].state is PENDING and not table.free and not table.reissue
    assert sorted(table.to_send) == [1, 2, 3] and sorted(table.to_ask) == [1, 2, 3]
    assert table.check() == []
    _carry_out(access)
    table.to_send.clear()
    custody.on_release([[0, a]])  # the writer's late DONE
    assert table.records[0].state is PENDING and table.to_send == [0] and access.counts["released"] == 1
    assert table.check() == []


def test_a_late_answer_of_a_silent_worker_gives_its_slot_back() -> None:
    access, delivery, custody = _parts(2)
    (req,) = _ask(access, [0])
    token = "here:1:1"
    table = access.table
    table.asked_directly(table.records[0], token)
    access.headers.set_claims([0], new_writer_id())
    table.quarantine(table.records[0], token, late_request=req)
    table.reissue_free(0.0)
    _carry_out(access)
    assert table.records[1].request_id == req  # its sample is asked for in slot 1
    delivery.on_complete(1, [[0, req, True]], notice=True)  # the silent worker answers late
    assert table.records[0].state is PENDING and table.records[0].request_id != req
    assert access.counts["released"] == 1 and access.counts["rejected"] == 0
    assert table.check() == []
    del custody


def test_a_declined_direct_request_goes_to_the_broker_with_the_same_id() -> None:
    access, _, custody = _parts()
    (req,) = _ask(access, [0])
    table = access.table
    table.set_lanes([table.records[0]], ("/tmp/lane", "here:1:1"))
    table.asked_directly(table.records[0], "here:1:1")
    custody.on_declined([[0, req]], "busy")
    record = table.records[0]
    assert (record.state, record.route, record.holder, record.lane) == (PENDING, Route.BROKER, None, None)
    assert record.request_id == req and table.to_send == [0] and not table.to_ask
    assert table.check() == []


def test_an_overdue_commit_whose_notice_was_lost_is_taken() -> None:
    access, _, custody = _parts(2)
    a, b = _ask(access, [0, 1])
    _commit(access, 0, a, GONE_WRITER)  # committed, announced by nobody
    custody.beat_checks(now=100.0)  # stalled: past STALL_DEADLINES deadlines
    table = access.table
    assert table.records[0].state is READY
    renewed = table.records[1]  # nobody writes it: asked again, its request re-issued (no FREE slot)
    assert renewed.state is PENDING and renewed.request_id != b and table.reissue[0][0] == b
    assert renewed.overdue == 1 and table.to_send == [1]
    assert table.check() == []


def test_a_writer_that_is_gone_gives_its_slots_back() -> None:
    access, _, custody = _parts(2)
    (req, _other) = _ask(access, [0, 1])
    table = access.table
    table.left_to_writer(table.records[0], GONE_WRITER)
    custody.beat_checks(now=0.05)
    record = table.records[0]
    assert (record.route, record.holder, record.request_id) == (Route.BROKER, None, req)
    assert table.to_send == [0] and table.records[1].state is PENDING
    assert not any(r.state is FREE for r in table.records) and table.check() == []
