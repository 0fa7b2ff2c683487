"""Group 9 of issue 21 (the worker's side): a recycled segment name is never written
through a stale mapping.

A real worker process maps a student's segment and fills a slot of it. The student
goes away (unlinks the segment) and a new owner creates a segment of the very same
name. The worker must write the next fill into the new file, not into its old map (an
unlinked file no one reads: the new student's slot would stay empty, and a larger old
map could take writes past the new segment's end).
"""

from __future__ import annotations

import pytest

from distill.pipeline.mediums.shm import SharedMemoryManager
from distill.pipeline.slot import HeaderTable, check_slot, slot_stride
from tests import peers
from tests.fakes import FakeBroker


@pytest.mark.timeout(60)
def test_a_worker_writes_the_new_segment_of_a_recycled_name(procs, endpoints) -> None:
    config = peers.batch_config()
    stride = slot_stride(config.nbytes())
    fake = FakeBroker(endpoints)
    try:
        procs.start(peers.run_worker, endpoints, name="worker")
        fake.wait_ready()
        first = SharedMemoryManager(2, stride, run_id="recycled", payload_bytes=config.nbytes())
        name = first.buf_name
        HeaderTable(first.buf, stride).ask([0], [1])
        fake.work(1, [[name, 0, stride, 1]])
        assert fake.wait_done(1) == []
        assert check_slot(first.slot_view(0), 1, 1, config.nbytes()) is None  # mapped and written
        first.close()  # unlinked: the name is free
        second = SharedMemoryManager(4, stride, run_id="recycled", name=name, payload_bytes=config.nbytes())
        try:
            HeaderTable(second.buf, stride).ask([0, 3], [2, 3])
            fake.work(2, [[name, 0, stride, 2], [name, 3, stride, 3]])  # within the worker's re-check interval
            assert fake.wait_done(2) == []
            for slot, request in ((0, 2), (3, 3)):
                assert check_slot(second.slot_view(slot), 1, request, config.nbytes()) is None, \
                    "the worker wrote the old segment of this name, not the new one"
        finally:
            second.close()
    finally:
        fake.close()
