"""The per-slot state machine (``slots.py``): every move is one the diagram allows, the
queues always index exactly the records in their state, and ``check`` finds any break.
A seeded random walk drives a table through every move many times."""

from __future__ import annotations

import random

import pytest

from distill.pipeline.student.slots import (
    FREE,
    OUT,
    PENDING,
    QUARANTINED,
    READY,
    TRANSITIONS,
    Route,
    SlotState,
    SlotStateError,
    SlotTable,
    random_request_ids,
)


def test_request_ids_are_random_nonzero_and_distinct() -> None:
    ids = random_request_ids(10_000)
    assert len(set(ids)) == 10_000 and all(0 < i < 2**63 for i in ids)
    assert random_request_ids(0) == []


def test_a_slot_goes_round_and_fill_numbers_count_up() -> None:
    table = SlotTable(3)
    asked = table.ask([0, 1, 2], now=0.0, from_free=True)
    assert [r.fill for r in asked] == [1, 2, 3] and all(r.state is PENDING for r in asked)
    assert not table.free and table.to_send == [0, 1, 2]
    table.accept([asked[1]], generation=7)
    assert table.ready[0] == (1, 7, asked[1].request_id)
    table.take_many(1, 0)
    assert asked[1].state is OUT
    before = asked[1].request_id
    again = table.ask([1], now=1.0)[0]
    assert again is asked[1] and again.fill == 4 and again.request_id != before
    assert table.check() == []


def test_moves_outside_the_diagram_are_refused() -> None:
    table = SlotTable(2)
    record = table.records[0]
    with pytest.raises(SlotStateError):
        table.accept([record], generation=1)  # FREE -> READY
    with pytest.raises(SlotStateError):
        table.move(record, QUARANTINED)  # FREE -> QUARANTINED
    for state, allowed in TRANSITIONS.items():
        for target in SlotState:
            record.state = state
            if target in allowed:
                table.move(record, target)
            else:
                with pytest.raises(SlotStateError):
                    table.move(record, target)


def test_quarantine_reissues_the_request_and_renew_keeps_it() -> None:
    table = SlotTable(3)
    a, b, c = table.ask([0, 1, 2], now=0.0, from_free=True)
    assert table.to_ask == [0, 1, 2]
    table.to_send.clear()
    table.to_ask.clear()  # sent, headers asked (the pool's part)
    table.quarantine(a, holder=42)
    assert table.reissue[0] == (a.request_id, a.fill)
    table.renew(b, now=2.0, keep_request=True)
    assert b.request_id not in (a.request_id,) and len(table.reissue) == 2
    table.accept([c], generation=1)
    table.take_many(1, 0)
    (d,) = table.ask([2], now=3.0)  # the next slot asked carries the oldest re-issued one
    assert (d.request_id, d.fill) == (a.request_id, a.fill)
    assert table.check() == []


def test_check_finds_what_is_broken() -> None:
    table = SlotTable(4)
    table.ask([0, 1], now=0.0, from_free=True)
    assert table.check() == []
    table.records[2].state = READY  # a READY slot missing from the ready queue
    assert any("ready queue" in p for p in table.check())
    table.records[2].state = FREE
    table.records[1].request_id = table.records[0].request_id
    assert any("same request id" in p for p in table.check())
    table.records[1].request_id = 99
    table.records[0].route = Route.DIRECT
    assert any("without a holder" in p for p in table.check())
    table.records[0].route = Route.BROKER
    table.free.append(0)
    assert any("free queue" in p for p in table.check())


def test_a_random_walk_keeps_every_invariant() -> None:
    rng = random.Random(21)
    table = SlotTable(16)
    now = 0.0
    for _step in range(5_000):
        now += 0.01
        records = table.records
        move = rng.randrange(7)
        if move == 0 and table.free:
            table.ask(list(table.free)[:rng.randint(1, len(table.free))], now, from_free=True)
        elif move == 1:
            pending = [r for r in records if r.state is PENDING]
            if pending:
                table.accept(rng.sample(pending, rng.randint(1, len(pending))), generation=rng.randint(1, 3))
        elif move == 2 and table.ready:
            table.take_many(rng.randint(1, 4), rng.randint(0, 3))
        elif move == 3:
            out = [r.idx for r in records if r.state is OUT]
            if out:
                table.ask(rng.sample(out, rng.randint(1, len(out))), now)
        elif move == 4:
            pending = [r for r in records if r.state is PENDING]
            if pending:
                table.quarantine(rng.choice(pending), holder=rng.choice([7, "token"]))
        elif move == 5:
            held = [r for r in records if r.state is QUARANTINED]
            if held:
                table.ask([rng.choice(held).idx], now)
        elif move == 6:
            pending = [r for r in records if r.state is PENDING]
            if pending:
                table.renew(rng.choice(pending), now, keep_request=rng.random() < 0.5)
        table.to_send = [s for s in table.to_send if records[s].state is PENDING]  # (accepted unsent)
        assert table.check() == [], f"step {_step}: {table.check()}"
        table.to_ask.clear()  # the pool asks their headers
