"""Group 4 of issue 21 (the worker's side): a worker takes a segment's slot geometry
from the header its owner wrote into the segment, never from the request.

A real worker process, driven through a fake broker backend, is handed WORK for a real
student segment whose slots 1 and 2 hold samples the owner is using: items with a stride
of slot size + 64 (which put a header inside slot 1's sample and the payload over slot
2's header), twice the stride, a slot past the segment's last, and a slot index of
2**31. None of it may change a byte of the segment; each item fails with the reason.
"""

from __future__ import annotations

import random

import pytest

from distill.pipeline.mediums.shm import SharedMemoryManager
from distill.pipeline.slot import HeaderTable, check_slot, slot_stride
from tests import peers
from tests.fakes import FakeBroker

SLOTS = 4


@pytest.mark.timeout(60)
def test_a_worker_writes_no_byte_outside_the_geometry_the_owner_wrote(procs, endpoints) -> None:
    config = peers.batch_config()
    stride = slot_stride(config.nbytes())
    fake = FakeBroker(endpoints)
    try:
        procs.start(peers.run_worker, endpoints, name="worker")
        with SharedMemoryManager(SLOTS, stride, run_id="geometry", payload_bytes=config.nbytes()) as owner:
            owner.buf[:] = random.Random(0).randbytes(SLOTS * stride)  # the samples the owner holds
            held = bytes(owner.buf)
            fake.wait_ready()
            name = owner.buf_name
            forged = [[name, 1, stride + 64, 11], [name, 1, 2 * stride, 12], [name, SLOTS, stride, 13],
                      [name, 2**31, stride, 14], [name, 0, stride - 64, 15]]
            fake.work(1, forged)
            failed = dict(fake.wait_done(1))
            assert bytes(owner.buf) == held, "the worker wrote into slots it was not given in their geometry"
            assert sorted(failed) == list(range(len(forged))), failed
            assert "stride" in failed[0] and "stride" in failed[1] and "stride" in failed[4], failed
            assert "outside" in failed[2] and "outside" in failed[3], failed
            # The same worker still fills a slot that is asked for at the segment's geometry.
            HeaderTable(owner.buf, stride).ask([3], [21])
            fake.work(2, [[name, 3, stride, 21]])
            assert fake.wait_done(2) == []
            assert check_slot(owner.slot_view(3), 1, 21, config.nbytes()) is None
            assert bytes(owner.buf[:3 * stride]) == held[:3 * stride]
    finally:
        fake.close()


@pytest.mark.timeout(60)
def test_a_worker_refuses_a_segment_whose_samples_are_not_its_size(procs, endpoints) -> None:
    """The owner declares its sample size in the segment header: a worker of another
    batch_config fails every item at once, naming both sizes, and writes nothing."""
    config = peers.batch_config()
    stride = slot_stride(config.nbytes())
    fake = FakeBroker(endpoints)
    try:
        procs.start(peers.run_worker, endpoints, name="worker", floats=peers.PAYLOAD_FLOATS - 16)
        with SharedMemoryManager(SLOTS, stride, run_id="sizes", payload_bytes=config.nbytes()) as owner:
            HeaderTable(owner.buf, stride).ask([0], [5])
            before = bytes(owner.buf)
            fake.wait_ready()
            fake.work(1, [[owner.buf_name, 0, stride, 5]])
            (idx, reason), = fake.wait_done(1)
            assert idx == 0 and f"{config.nbytes()}-byte samples" in reason, reason
            assert bytes(owner.buf) == before
    finally:
        fake.close()
