"""A student's shared memory is exactly ``slot_count x slot stride`` (the sizing formula of docs/pipeline.md),
plus the 64-byte segment header behind the slots.

Measured from the outside: the segments this process created in /dev/shm, their
size and the blocks tmpfs actually allocated for them (``posix_fallocate``
reserves the whole segment up front, so allocated == size, rounded to pages).
"""

from __future__ import annotations

import os

import pytest

from distill.pipeline import BatchConfig, TensorSpec
from distill.pipeline.mediums.shm import SHM_DIR, list_segments
from distill.pipeline.slot import HEADER_BYTES, SLOT_ALIGN, segment_bytes, slot_stride
from distill.pipeline.student.pool import SlotPool
from distill.stages import sample_batch_config

PAGE = os.sysconf("SC_PAGE_SIZE")


def _mine() -> set[str]:
    return {name for name in list_segments() if f"_{os.getpid()}_" in name}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("slot_count", "config"), [
    (1, BatchConfig([TensorSpec("x", (1,), "uint8")])),
    (7, BatchConfig([TensorSpec("x", (1000,), "float32"), TensorSpec("t", (3,), "int64")])),
    (32, sample_batch_config(2, 128, 128, "bfloat16")),  # the default run's sample: 1 layer per stage
])
def test_student_shared_memory_is_slot_count_times_stride(tmp_path, slot_count: int, config: BatchConfig) -> None:
    before = _mine()
    pool = SlotPool(f"ipc://{tmp_path}/frontend.sock", "size", slot_count, config.nbytes(),
                    lambda: 0, lambda _: None)
    try:
        (name,) = _mine() - before  # one segment per pool, nothing else
        stride = slot_stride(config.nbytes())
        assert stride % SLOT_ALIGN == 0 and config.nbytes() + HEADER_BYTES <= stride < config.nbytes() + 2 * SLOT_ALIGN
        st = os.stat(os.path.join(SHM_DIR, name))
        assert st.st_size == segment_bytes(slot_count, stride) == slot_count * stride + 64
        allocated = st.st_blocks * 512
        assert allocated == -(-st.st_size // PAGE) * PAGE
    finally:
        pool.close()
    assert _mine() == before
