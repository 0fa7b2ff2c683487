"""The worker's parts, in one process: its typed config (and the seed README's
keywords), and the claim rules of ``worker/claims.py`` and ``worker/segments.py``
against real shared memory: a fill asked again, another live writer, a dead writer's
claim, the owner's fair share, a commit over a lost claim."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from distill.pipeline import Worker, WorkerConfig
from distill.pipeline.liveness import new_writer_id, writer_alive
from distill.pipeline.mediums.shm import SHM_DIR, SharedMemoryManager
from distill.pipeline.mediums.tcp import TcpSender
from distill.pipeline.sizing import worker_batch
from distill.pipeline.slot import HEADER_BYTES, HeaderTable, check_slot, slot_stride
from distill.pipeline.worker import claims
from distill.pipeline.worker.commit import Committer
from distill.pipeline.worker.config import SlotTarget
from distill.pipeline.worker.fill import KEPT_VIEW, NO_LAYOUT, Filler, Run
from distill.pipeline.worker.segments import Segments
from tests import peers

PAYLOAD = peers.batch_config().nbytes()
STRIDE = slot_stride(PAYLOAD)


def test_the_seed_readme_keywords_and_a_config_object_make_the_same_worker() -> None:
    def generate(model_id: str, model_cfg: dict | None) -> bytes:
        return bytes(PAYLOAD)

    readme = Worker(generator_fn=generate, slot_size=PAYLOAD, backend_endpoint="ipc:///x/b.sock",
                    control_pub_endpoint="ipc:///x/p.sock", worker_id=7)
    config = Worker(generate, config=WorkerConfig(slot_size=PAYLOAD, backend_endpoint="ipc:///x/b.sock",
                                                  control_pub_endpoint="ipc:///x/p.sock", worker_id=7))
    assert readme.config == config.config
    assert readme.slot_size == PAYLOAD and readme.worker_id == 7
    assert readme.max_batch == worker_batch(PAYLOAD) and readme.capacity == 2 * readme.max_batch  # chosen
    both = Worker(generate, config=WorkerConfig(slot_size=PAYLOAD, max_batch=4), max_batch=8)
    assert both.max_batch == 8 and both.slot_size == PAYLOAD  # keywords over the config object


def test_bad_settings_name_what_to_change() -> None:
    with pytest.raises(TypeError, match="max_bach.*WorkerConfig"):
        Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(), max_bach=4)
    with pytest.raises(ValueError, match="exactly one of generator_fn"):
        Worker(slot_size=PAYLOAD)
    with pytest.raises(ValueError, match="slot_size= .* or batch_config="):
        Worker(batch_fn=peers.fill_targets)
    with pytest.raises(ValueError, match="slot_size 8 != batch_config.nbytes"):
        WorkerConfig(slot_size=8, batch_config=peers.batch_config())
    with pytest.raises(ValueError, match="max_batch=0"):
        WorkerConfig(slot_size=8, max_batch=0)


def test_writer_ids_name_live_processes_only() -> None:
    mine, other = new_writer_id(), new_writer_id()
    assert mine != other and mine >> 32 == other >> 32  # one process, two writers
    assert writer_alive(mine) is True and writer_alive(0) is None
    dead = subprocess.run([sys.executable, "-c", "from distill.pipeline.liveness import new_writer_id as n; "
                           "print(n())"], capture_output=True, text=True, timeout=60)
    assert writer_alive(int(dead.stdout)) is False


@pytest.fixture
def segment():
    with SharedMemoryManager(4, STRIDE, run_id="claims", payload_bytes=PAYLOAD) as owner:
        segments = Segments(PAYLOAD, None)
        try:
            yield owner, segments, segments.fresh(owner.buf_name)
        finally:
            segments.close()


def test_a_claim_needs_the_asked_fill_and_no_other_live_writer(segment) -> None:
    owner, _segments, mapped = segment
    me, rival = new_writer_id(), new_writer_id()
    table = HeaderTable(owner.buf, STRIDE)
    table.ask([0, 1, 2, 3], [10, 11, 12, 13])
    table.set_claims([1], rival)  # another live writer has slot 1
    dead = subprocess.run([sys.executable, "-c", "from distill.pipeline.liveness import new_writer_id as n; "
                           "print(n())"], capture_output=True, text=True, timeout=60)
    table.set_claims([2], int(dead.stdout))  # a writer that is gone: its claim is taken over
    taken, refused, later = claims.claim(mapped, [0, 1, 2, 3], [10, 11, 12, 99], me, limit=None)
    assert (taken, refused, later) == ([0, 2], [1, 3], [])  # 3: asked for another fill
    assert table.claims([0, 1, 2, 3])[0] == [me, rival, me, 0] and mapped.claimed == 2
    assert claims.still_claimed(mapped, [0, 2], [10, 12], me) == [True, True]
    table.ask([2], [20])  # the student asks for slot 2 again: the claim no longer stands
    assert claims.still_claimed(mapped, [0, 2], [10, 12], me) == [True, False]


def test_the_owners_fair_share_bounds_a_writers_claims(segment) -> None:
    owner, segments, mapped = segment
    me = new_writer_id()
    HeaderTable(owner.buf, STRIDE).ask([0, 1, 2, 3], [1, 2, 3, 4])
    owner.set_max_claims(3)
    assert mapped.room() == 3
    taken, refused, later = claims.claim(mapped, [0, 1], [1, 2], me, limit=mapped.room())
    assert taken == [0, 1] and mapped.room() == 1
    taken, refused, later = claims.claim(mapped, [2, 3], [3, 4], me, limit=mapped.room())
    assert (taken, later) == ([0], [1])  # slot 3 waits for a later batch
    claims.settle(mapped, 3)
    assert mapped.room() == 3
    mapped.claimed = 2  # counts out of step with the batches (a bug): reset between batches
    assert segments.reset_claims() and mapped.claimed == 0 and not segments.reset_claims()
    owner.set_max_claims(0)
    assert mapped.room() is None


def test_a_commit_is_written_only_over_a_standing_claim(segment) -> None:
    owner, segments, mapped = segment
    me = new_writer_id()
    table = HeaderTable(owner.buf, STRIDE)
    table.ask([0, 1], [5, 6])
    claims.claim(mapped, [0, 1], [5, 6], me, limit=None)
    table.ask([1], [7])  # the student gave up on slot 1's fill (a restart, a deadline)
    run = Run(1, owner.buf_name, STRIDE, mapped, None, [0, 1], [0, 1],
              [SlotTarget(5, 3, segments.slot(mapped, 0, STRIDE)[0], None),
               SlotTarget(6, 3, segments.slot(mapped, 1, STRIDE)[0], None)])
    failed: dict = {}
    committer = Committer(me, False, TcpSender(), "test", segments)
    committer.commit(run, [PAYLOAD, PAYLOAD], failed)
    assert failed == {1: {1: claims.STALE}}
    assert check_slot(owner.slot_view(0), 3, 5, PAYLOAD) is None
    assert table.header(1) is None  # nothing committed over the new fill
    assert mapped.claimed == 0


def test_a_segment_its_owner_shrank_is_refused_grown_back_and_never_written_again(segment) -> None:
    """Issue 37, item 6, in one process: what the worker asks before it touches a segment
    (the worker process surviving it: ``tests/integration/test_shrunk_segment.py``)."""
    owner, segments, mapped = segment
    me = new_writer_id()
    HeaderTable(owner.buf, STRIDE).ask([0, 3], [5, 6])
    claims.claim(mapped, [0, 3], [5, 6], me, limit=None)
    assert segments.check_size(mapped) is None
    path = os.path.join(SHM_DIR, owner.buf_name)
    size = os.stat(path).st_size
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, 100)  # nothing here touches the slots again until it is grown back
    finally:
        os.close(fd)
    claims.give_up(mapped, [0, 3], me)  # writes nothing into a shrunk segment (no SIGBUS)
    why = segments.check_size(mapped)
    assert why is not None and f"shrank to 100 of its {size} bytes" in why
    assert owner.buf_name not in segments and mapped.table is None  # dropped
    assert os.stat(path).st_size == size  # grown back, for copies already in flight
    assert segments.check_size(mapped) == why  # and still never written through this mapping
    with pytest.raises(ValueError, match="no segment header"):  # mapped anew: checked like any other
        segments.fresh(owner.buf_name)


def test_segments_refuse_other_sample_sizes_and_foreign_geometry(segment) -> None:
    owner, _segments, mapped = segment
    with pytest.raises(ValueError, match=f"hold {PAYLOAD}-byte samples, this worker makes {PAYLOAD - 4}"):
        Segments(PAYLOAD - 4, None).fresh(owner.buf_name)
    segments = Segments(PAYLOAD, None)
    with pytest.raises(ValueError, match="stride"):
        segments.slot(mapped, 0, STRIDE + 64)
    with pytest.raises(IndexError, match="outside"):
        segments.slot(mapped, 4, STRIDE)


def test_a_segment_gone_with_its_student_fails_its_slots_without_a_warning(caplog) -> None:
    """A student that closes unlinks its segment while requests for it may still be queued at
    a worker: each normal exit is not a bad address to warn about (the broker still says so,
    at WARNING, when the student is alive: ``test_broker``)."""
    with SharedMemoryManager(4, STRIDE, run_id="left", payload_bytes=PAYLOAD) as owner:
        gone = owner.buf_name  # unlinked when its student closes it
    filler = Filler(WorkerConfig(slot_size=PAYLOAD), lambda *_: b"", None, Segments(PAYLOAD, None), TcpSender(),
                    new_writer_id(), "test")
    failed: dict = {}
    with caplog.at_level(logging.DEBUG, logger="distill.pipeline.worker.fill"):
        filler.add_targets({"work_id": 1, "items": [[gone, 0, STRIDE, 10]]}, 3, [], failed, range(1))
    assert failed[1][0].startswith("bad address:"), failed
    assert [r.levelno for r in caplog.records] == [logging.DEBUG], caplog.records
    assert "is gone (its student left)" in caplog.records[0].getMessage()


def _fill_once(owner: SharedMemoryManager, segments: Segments, config: WorkerConfig, generator_fn,
               stride: int = STRIDE) -> dict:
    """One WORK over the segment's four slots, through the worker's Filler and Committer:
    the failures by item (each slot asked for fill 10 + its index, generation 3)."""
    me = new_writer_id()
    HeaderTable(owner.buf, stride).ask([0, 1, 2, 3], [10, 11, 12, 13])
    filler = Filler(config, generator_fn, None, segments, TcpSender(), me, "test")
    body = {"work_id": 1, "items": [[owner.buf_name, idx, stride, 10 + idx] for idx in range(4)]}
    runs: list[Run] = []
    failed: dict = {}
    assert filler.add_targets(body, 3, runs, failed, range(4)) == []
    lengths, finish = filler.generate("m", None, [t for run in runs for t in run.targets])
    assert finish is None
    Committer(me, False, TcpSender(), "test", segments).commit_runs(runs, lengths, failed)
    return failed.get(1, {})


def test_a_generator_returns_bytes_or_tensors_and_bad_tensors_fail_their_slot_only() -> None:
    config = peers.batch_config()
    floats = config.get_spec("x").shape[0]
    good = {"x": torch.arange(floats, dtype=torch.float32), "tag": torch.tensor([4, 2])}
    returns = iter([good,  # straight into the slot's views
                    {**good, "x": good["x"].double()},  # float64 for a float32 spec
                    config.encode(x=good["x"] + 1, tag=torch.tensor([7, 7])),  # the seed README's bytes
                    {"x": good["x"]}])  # "tag" missing
    with SharedMemoryManager(4, STRIDE, run_id="gen", payload_bytes=PAYLOAD) as owner:
        segments = Segments(PAYLOAD, config.decode)
        try:
            failed = _fill_once(owner, segments, WorkerConfig(batch_config=config), lambda *_: next(returns))
            assert set(failed) == {1, 3}
            assert "dtype torch.float64 != spec torch.float32" in failed[1] and "missing ['tag']" in failed[3]
            for slot, (x, tag) in {0: (good["x"], [4, 2]), 2: (good["x"] + 1, [7, 7])}.items():
                assert check_slot(owner.slot_view(slot), 3, 10 + slot, PAYLOAD) is None
                sample = config.decode(owner.slot_view(slot)[HEADER_BYTES:])
                assert torch.equal(sample["x"], x) and sample["tag"].tolist() == tag
            assert check_slot(owner.slot_view(1), 3, 11, PAYLOAD) is not None  # never committed
        finally:
            segments.close()


def test_a_generator_returning_tensors_without_a_batch_config_is_told_to_pass_one() -> None:
    config = peers.batch_config()
    sample = {"x": torch.zeros(config.get_spec("x").shape), "tag": torch.zeros(2, dtype=torch.int64)}
    with SharedMemoryManager(4, STRIDE, run_id="gen", payload_bytes=PAYLOAD) as owner:
        segments = Segments(PAYLOAD, None)
        try:
            failed = _fill_once(owner, segments, WorkerConfig(slot_size=PAYLOAD), lambda *_: sample)
        finally:
            segments.close()
    assert failed == dict.fromkeys(range(4), NO_LAYOUT) and "Worker(batch_config=" in NO_LAYOUT


def test_a_large_encode_is_written_into_the_slot_once_and_a_kept_result_fails_its_slot() -> None:
    """The seed README's generator (``return config.encode(...)``, a Worker with only
    ``slot_size``) on samples over ``ENCODE_INTO_MIN_BYTES``: the sample is in the slot
    without a second copy; a generator that returns an earlier call's result fails that
    slot with why, and the worker goes on."""
    config = peers.batch_config(floats=20_000)
    payload = config.nbytes()
    stride = slot_stride(payload)
    calls: list = []

    def generate(model_id: str, model_cfg: dict | None):
        call = len(calls)
        x = torch.arange(20_000, dtype=torch.float32) + 100 * call
        data = config.encode(x=x, tag=torch.tensor([call, 7]))
        calls.append(data)
        if call == 1:
            return calls[0]  # kept from the call before: released, refused
        if call == 2:
            return config.encode(x=x + 1, tag=torch.tensor([call, 8]))  # the second encode: bytes
        return data

    with SharedMemoryManager(4, stride, run_id="gen", payload_bytes=payload) as owner:
        segments = Segments(payload, None)
        try:
            failed = _fill_once(owner, segments, WorkerConfig(slot_size=payload), generate, stride)
            assert failed == {1: KEPT_VIEW} and "bytes(data)" in KEPT_VIEW
            assert isinstance(calls[0], memoryview) and type(calls[2]) is memoryview
            for slot, (shift, tag) in {0: (0, [0, 7]), 2: (201, [2, 8]), 3: (300, [3, 7])}.items():
                assert check_slot(owner.slot_view(slot), 3, 10 + slot, payload) is None
                sample = config.decode(owner.slot_view(slot)[HEADER_BYTES:HEADER_BYTES + payload])
                assert torch.equal(sample["x"], torch.arange(20_000, dtype=torch.float32) + shift)
                assert sample["tag"].tolist() == tag
        finally:
            segments.close()


@pytest.mark.timeout(60)
def test_a_worker_without_a_broker_says_where_it_looks_and_for_how_long(
        endpoints, caplog: pytest.LogCaptureFixture) -> None:
    worker = Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(),
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
                    heartbeat_interval_s=0.1, heartbeat_liveness=2)
    with caplog.at_level(logging.WARNING, logger="distill.pipeline.worker.loop"):
        worker.start()
        deadline = time.monotonic() + 20
        while "registering again" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        worker.stop()
    assert re.search(rf"worker \S+: broker at {re.escape(endpoints['backend'])} has not answered yet; "
                     "registering again", caplog.text), caplog.text
