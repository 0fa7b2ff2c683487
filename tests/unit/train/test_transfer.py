"""The GPU copy paths (``distill.train.transfer``) against plain copies, on CPU and on CUDA.

The CPU cases check the fallback that every CPU run takes; the CUDA cases (marked
``gpu``, skipped without CUDA) check the pinned, side-stream, non-blocking paths
against the same reference.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from distill.pipeline import BatchConfig, DistillIterableDataset, TensorSpec
from distill.teacher.transfer import DeviceToSlots
from distill.train.transfer import BackgroundBatches, DevicePrefetcher, loader_batches

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def _states(device: str, positions: int, batch: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, 8, 16, generator=generator).to(device) for _ in range(positions)]


@pytest.mark.parametrize("device", DEVICES)
def test_device_to_slots_writes_every_state_of_every_sample(device: str) -> None:
    batch, positions, max_positions = 5, 2, 3
    dests_BPTD = torch.full((batch, max_positions, 8, 16), -1.0)  # slots sized for the largest stage
    states = _states(device, positions, batch, seed=0)
    finish = DeviceToSlots(device).start(states, list(dests_BPTD))
    finish()
    for i in range(batch):
        for j in range(positions):
            torch.testing.assert_close(dests_BPTD[i, j], states[j][i].cpu())
    assert bool((dests_BPTD[:, positions:] == -1).all())  # nothing past the stage's positions


@pytest.mark.parametrize("device", DEVICES)
def test_device_to_slots_batches_in_flight_do_not_overwrite_each_other(device: str) -> None:
    """The worker starts batch n+1 before it finishes batch n: both must land intact."""
    copier = DeviceToSlots(device)
    first, second = torch.zeros(4, 1, 8, 16), torch.zeros(3, 1, 8, 16)
    states_a, states_b = _states(device, 1, 4, seed=1), _states(device, 1, 3, seed=2)
    finish_a = copier.start(states_a, list(first))
    finish_b = copier.start(states_b, list(second))
    finish_a()
    finish_b()
    torch.testing.assert_close(first[:, 0], states_a[0].cpu())
    torch.testing.assert_close(second[:, 0], states_b[0].cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_prefetcher_yields_every_batch_in_order_on_the_device(device: str) -> None:
    host = [{"x": torch.full((4, 32), float(i)).pin_memory() if device == "cuda" else torch.full((4, 32), float(i)),
             "ids": torch.arange(4) + i} for i in range(5)]
    got = list(DevicePrefetcher(iter(host), device))
    assert len(got) == len(host)
    for i, batch in enumerate(got):
        assert batch["x"].device.type == device
        torch.testing.assert_close(batch["x"].cpu(), host[i]["x"])
        torch.testing.assert_close(batch["ids"].cpu(), host[i]["ids"])
    if device == "cpu":
        assert all(a is b for a, b in zip(got, host, strict=True))  # CPU: passed through, no copy


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_pinned_batches_without_cuda_name_the_setting() -> None:
    config = BatchConfig([TensorSpec("x", (4,), "float32")])
    with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
        DistillIterableDataset(0, None, 8, config, "ipc:///nonexistent", batch_size=4, pin_memory=True)
    with pytest.raises(ValueError, match="reuse_batches"):
        DistillIterableDataset(0, None, 8, config, "ipc:///nonexistent", batch_size=4, pin_memory=True,
                               reuse_batches=True)


class _Source:
    """A batch generator that records which thread made, advanced and closed it."""

    def __init__(self, count: int, fail_at: int | None = None) -> None:
        self.count, self.fail_at = count, fail_at
        self.threads: dict[str, set[str]] = {"made": set(), "advanced": set(), "closed": set()}
        self.produced = 0

    def __call__(self):
        self.threads["made"].add(threading.current_thread().name)
        return self._batches()

    def _batches(self):
        try:
            for i in range(self.count):
                self.threads["advanced"].add(threading.current_thread().name)
                if i == self.fail_at:
                    raise TimeoutError("no sample for 5s")
                self.produced += 1
                yield {"x": torch.full((2,), i)}
        finally:
            self.threads["closed"].add(threading.current_thread().name)


def test_background_batches_in_order_then_stop_all_in_its_thread() -> None:
    source = _Source(5)
    batches = BackgroundBatches(source, depth=2, name="bg-test")
    assert [int(b["x"][0]) for b in batches] == [0, 1, 2, 3, 4]
    with pytest.raises(StopIteration):
        next(batches)
    assert source.threads == {"made": {"bg-test"}, "advanced": {"bg-test"}, "closed": {"bg-test"}}


def test_background_batches_hand_the_iterators_error_to_the_caller() -> None:
    batches = BackgroundBatches(_Source(5, fail_at=2), depth=1)
    assert int(next(batches)["x"][0]) == 0
    assert int(next(batches)["x"][0]) == 1
    with pytest.raises(TimeoutError, match="no sample"):
        next(batches)


def test_background_batches_close_stops_a_blocked_producer_and_closes_the_iterator() -> None:
    source = _Source(10_000)
    batches = BackgroundBatches(source, depth=2, name="bg-close")
    next(batches)
    batches.close(timeout_s=10)
    assert source.threads["closed"] == {"bg-close"}
    assert source.produced <= 1 + 2 + 1  # taken, queued, and the one it was handing over
    with pytest.raises(StopIteration):
        next(batches)


def test_background_batches_refuse_no_lookahead() -> None:
    with pytest.raises(ValueError, match="depth"):
        BackgroundBatches(lambda: iter([]), depth=0)


@pytest.mark.parametrize("device", DEVICES)
def test_background_batches_feed_the_device_prefetcher(device: str) -> None:
    """The student's path with loader_workers=0: host batches made in the gathering
    thread (pinned there on CUDA), copied to the device on the prefetcher's side stream."""
    cuda = device == "cuda"

    def host_batches():
        for i in range(6):
            yield {"x": torch.full((4, 16), float(i), pin_memory=cuda), "ids": torch.arange(4) + 10 * i}

    background = BackgroundBatches(host_batches, depth=2)
    try:
        got = list(DevicePrefetcher(background, device))
    finally:
        background.close()
    assert len(got) == 6
    for i, batch in enumerate(got):
        assert batch["x"].device.type == device
        torch.testing.assert_close(batch["x"].cpu(), torch.full((4, 16), float(i)))
        torch.testing.assert_close(batch["ids"].cpu(), torch.arange(4) + 10 * i)


class _Ones(IterableDataset):
    def __iter__(self):
        while True:
            yield torch.ones(4)


class _Resets:
    """What a DataLoader iterator raises when the worker handing it a batch dies mid-handoff."""

    def __iter__(self):
        return self

    def __next__(self):
        raise ConnectionResetError(104, "Connection reset by peer")


def test_a_loader_worker_killed_mid_handoff_is_named_not_a_connection_reset() -> None:
    """A real DataLoader worker, killed; the handoff error then becomes torch's own message
    naming it. (Its iterator is made in a thread: torch's SIGCHLD handler, which would
    raise the same error on its own, is only installed from the main thread.)"""
    made: list = []
    maker = threading.Thread(target=lambda: made.append(iter(DataLoader(_Ones(), batch_size=None,
                                                                       num_workers=1))))
    maker.start()
    maker.join(60)
    live = made[0]
    try:
        assert next(live).tolist() == [1.0] * 4
        worker = live._workers[0]
        os.kill(worker.pid, signal.SIGKILL)  # not waited for: the reset may come before its death is seen
        with pytest.raises(RuntimeError, match=rf"DataLoader worker \(pid {worker.pid}\) is killed by signal"):
            next(loader_batches(_Resets()))
    finally:
        live._shutdown_workers()
    with pytest.raises(ConnectionResetError):  # no worker dead: the error as it came
        next(loader_batches(_Resets()))
