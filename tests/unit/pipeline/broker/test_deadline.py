"""The broker's deadlines on a worker (``broker/deadline.py``), on its records: a worker
that holds DIRECT slots and finishes no batch is stalled once its model's deadline passes,
and not before, nor while it makes progress, holds broker WORK or does not report batches.
(The integration test, ``test_direct_deadline.py``, gets there by either deadline: which
fires first there is a race between the DIRECT stall and a broker WORK the hung worker
may have been given.)"""

from __future__ import annotations

from distill.pipeline.broker.config import WORK_TIMEOUT_MIN_BEATS, BrokerConfig
from distill.pipeline.broker.deadline import BatchClock
from distill.pipeline.broker.records import Work, WorkerPeer

HEARTBEAT_S = 0.2


def _worker() -> WorkerPeer:
    return WorkerPeer(identity=b"w", peer_id="w", key=None, credit=4, capacity=4, max_batch=2, last_seen=0.0,
                      backlog=2, batches=3, progress_at=10.0, backlog_since=10.0, last_model="m", last_run="r")


def test_a_worker_holding_direct_slots_without_progress_is_stalled_past_its_deadline() -> None:
    clock = BatchClock(BrokerConfig.build(heartbeat_interval_s=HEARTBEAT_S))
    worker = _worker()
    clock.observe(worker, Work(1, b"w", "r", 1, [], 2, model_id="m", sent_at=9.0), 9.01)
    deadline = HEARTBEAT_S * WORK_TIMEOUT_MIN_BEATS  # 10 ms batches: the floor of heartbeats
    assert clock.stalled(worker, 10.0 + deadline * 0.9) is None
    elapsed, allowed, why = clock.stalled(worker, 10.0 + deadline * 1.1)
    assert allowed == deadline and elapsed > allowed and "heartbeats" in why
    worker.progress_at = 10.0 + deadline  # a batch finished meanwhile: the clock starts again
    assert clock.stalled(worker, 10.0 + deadline * 1.1) is None


def test_no_stall_without_direct_slots_with_broker_work_or_without_batch_reports() -> None:
    clock = BatchClock(BrokerConfig.build(heartbeat_interval_s=HEARTBEAT_S))
    late = 10.0 + 1000.0
    idle = _worker()
    idle.backlog = 0
    assert clock.stalled(idle, late) is None
    busy = _worker()
    busy.in_flight[1] = Work(1, b"w", "r", 1, [], 2, model_id="m", sent_at=10.0)  # timed by overdue()
    assert clock.stalled(busy, late) is None
    silent = _worker()
    silent.batches = None  # an older worker that does not say how many batches it finished
    assert clock.stalled(silent, late) is None
    assert clock.stalled(_worker(), late) is not None
