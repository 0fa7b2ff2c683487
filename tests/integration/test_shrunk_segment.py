"""Issue 37, item 6: a student that shrinks its own segment under a worker's mapping
cannot end the worker (which serves every run on the broker).

A real worker process, driven through a fake broker backend, maps a student's segment
by filling a slot of it. The student then truncates its segment to one slot's bytes and
asks for slots past the new end, and for the slot left: a write there used to kill the
worker with SIGBUS. The worker must stay alive, fail those items with the reason, and go
on filling another student's segment.
"""

from __future__ import annotations

import os

import pytest

from distill.pipeline.mediums.shm import SHM_DIR, SharedMemoryManager
from distill.pipeline.slot import HeaderTable, check_slot, slot_stride
from tests import peers
from tests.fakes import FakeBroker

SLOTS = 16


def _done(fake: FakeBroker, worker, work_id: int) -> list:
    """The failures DONE lists for ``work_id``; fails at once, with its exit code, if the
    worker died instead of answering."""
    try:
        return fake.wait_done(work_id, timeout_s=20)
    except AssertionError:
        pytest.fail(f"no DONE for WORK {work_id}: the worker's exit code is {worker.exitcode} (-7: SIGBUS)")


def _shrink(name: str, size: int) -> None:
    """What a hostile (or broken) student does to its own segment."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


@pytest.mark.timeout(90)
def test_a_student_that_shrinks_its_segment_cannot_end_the_worker(procs, endpoints) -> None:
    config = peers.batch_config()
    stride = slot_stride(config.nbytes())
    fake = FakeBroker(endpoints)
    try:
        worker = procs.start(peers.run_worker, endpoints, name="worker")
        fake.wait_ready()
        with SharedMemoryManager(SLOTS, stride, run_id="shrink", payload_bytes=config.nbytes()) as hostile:
            name = hostile.buf_name
            HeaderTable(hostile.buf, stride).ask([0], [1])
            fake.work(1, [[name, 0, stride, 1]])
            assert _done(fake, worker, 1) == []  # mapped, and written, by the worker
            _shrink(name, stride)  # (this process must not touch its slots past the first from now on)
            asked = [[name, slot, stride, 100 + slot] for slot in (SLOTS - 1, SLOTS // 2, 0)]
            fake.work(2, asked)
            failed = dict(_done(fake, worker, 2))
            assert worker.is_alive(), f"the worker died (exit code {worker.exitcode})"
            assert sorted(failed) == [0, 1, 2], failed
            assert all("shrank" in why for why in failed.values()), failed
            # Asked again, it maps the file anew and refuses what it finds there (no segment header).
            fake.work(3, [[name, SLOTS - 1, stride, 200]])
            (idx, why), = _done(fake, worker, 3)
            assert idx == 0 and why.startswith("bad address:"), why
        # The same worker goes on serving another student.
        with SharedMemoryManager(4, stride, run_id="after", payload_bytes=config.nbytes()) as other:
            HeaderTable(other.buf, stride).ask([3], [7])
            fake.work(4, [[other.buf_name, 3, stride, 7]])
            assert _done(fake, worker, 4) == []
            assert check_slot(other.slot_view(3), 1, 7, config.nbytes()) is None
        assert worker.is_alive()
    finally:
        fake.close()
