"""Group 10 of issue 21: one writer claim per slot fill, and no writer holds more than
its fair share of a student's slots.

- A worker is halfway through writing a slot when the broker is SIGKILLed. The
  restarted broker has a second worker; the student asks again for what it lost with
  the broker, but not for the slot the first worker claims: that worker finishes it,
  and the sample the student gets (and holds) is one writer's, never a mix of two
  (the teacher here is non-deterministic: each worker writes its own pid).
- A worker that hangs in its batch function (heartbeats go on) with a student's slots
  claims at most its fair share of them (half, before the student has seen two
  writers): another worker serves the student from the rest.

Real broker and worker processes, real shared memory.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from distill.pipeline import Broker, StudentClient
from distill.pipeline.slot import read_claim
from distill.pipeline.student.slots import SlotState
from tests import peers


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _writers(x: torch.Tensor) -> set[float]:
    return set(torch.unique(x).tolist())


@pytest.mark.timeout(90)
def test_a_slot_being_written_across_a_broker_restart_gets_one_writer(procs, endpoints, tmp_path: Path) -> None:
    mid = tmp_path / "mid"
    broker = procs.start(peers.run_broker, endpoints, name="broker")
    first = procs.start(peers.run_slow_writer, endpoints, str(mid), 3.0, name="first")
    with StudentClient(0, 1, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"], heartbeat_interval_s=0.2) as client:
        client.hello()
        generation = client.set_model("m")
        assert client.request_sample(timeout_ms=100) is None
        _wait_for(mid.exists, 30, "the first worker to start writing")
        os.kill(broker.pid, signal.SIGKILL)
        broker.join(10)
        procs.start(peers.run_broker, endpoints, name="broker2")
        (tmp_path / "second").write_text("its batches never pause")
        procs.start(peers.run_slow_writer, endpoints, str(tmp_path / "second"), 0.0, name="second")
        ref = client.request_sample(timeout_ms=30_000)
        assert ref is not None and ref.generation == generation
        _wait_for((tmp_path / "mid.done").exists, 30, "the first worker to finish its slot")
        time.sleep(0.2)  # its commit (or refusal to commit) is right behind
        writers = _writers(ref.tensors["x"])
        assert len(writers) == 1, f"the sample held by the student was written by {len(writers)} workers"
        assert writers == {float(first.pid)}, "the slot went to a second writer while the first was writing it"
        assert ref.tensors["tag"].tolist() == [ref.request_id, generation]
        client.release_slot(ref.slot_id)
        assert not client._pool.slots.check()


@pytest.mark.timeout(60)
def test_a_hung_worker_holds_no_more_than_its_share_and_another_serves_the_rest(
        procs, endpoints, broker_kwargs, tmp_path: Path) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    busy = tmp_path / "busy"
    procs.start(peers.run_freezing_worker, endpoints, str(busy), name="hung")
    try:
        with StudentClient(0, 8, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], heartbeat_interval_s=0.2) as client:
            client.hello()
            generation = client.set_model("m")
            assert client.request_sample(timeout_ms=100) is None  # all 8 asked of the only worker
            _wait_for(busy.exists, 30, "the worker to start (and hang in) its batch")
            assert int(busy.read_text()) <= 4, f"the hung worker holds {busy.read_text()} of 8 slots"
            # More credit than the hung one (whose heartbeats go on), so the broker hands the
            # slots asked for again to it (catching a hung batch is the broker's per-WORK deadline).
            procs.start(peers.run_worker, endpoints, name="healthy", max_batch=64)
            peers.consume_verified(client, generation, 100, timeout_ms=20_000,
                                   what="no sample while a hung worker held slots")
            pool = client._pool
            claims: dict[int, int] = {}
            for record in pool.slots.in_state(SlotState.PENDING):
                claim, _fill = read_claim(pool.medium.slot_view(record.idx))
                if claim:
                    claims[claim] = claims.get(claim, 0) + 1
            assert max(claims.values(), default=0) <= 4, claims
            assert not pool.slots.check()
    finally:
        broker.stop()
