"""The seed README's path with its default arguments delivers, exactly: a broker and a
README worker (``generator_fn``, every default) as processes, the README's student
(``StudentClient(slot_count=16)`` + ``DistillIterableDataset(slot_count=8)``, one sample
per item). Small samples are copied out a chunk at a time; large ones are lent as views
of their slots (``student/loans.py``): a lent sample must never change while it is held, a
consumer that keeps more samples than the pool has slots must still get them all, and
the DataLoader's batching must work on top. Figures: ``bench/pipeline.py --defaults``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch

from distill.pipeline import DistillIterableDataset, StudentClient
from distill.pipeline.student.loans import LEND_MIN_BYTES
from tests import peers

pytestmark = pytest.mark.timeout(90)

SLOTS = 8
"""The README's dataset pool."""


def _check(sample: dict[str, torch.Tensor], seen: set[tuple[int, int]]) -> None:
    x = sample["x"]
    writer, number = int(x[0]), int(x[1])
    assert bool((x[1:] == number).all()), f"sample {number} of {writer} torn or overwritten"
    assert (writer, number) not in seen, f"sample {number} of {writer} yielded twice"
    seen.add((writer, number))


@pytest.mark.parametrize("sample_bytes", [4 << 10, 256 << 10])
def test_the_readme_path_delivers_exact_samples_and_lent_ones_stay_put(procs, endpoints, sample_bytes) -> None:
    config = peers.readme_config(sample_bytes)
    procs.start(peers.run_broker, endpoints, name="broker")
    procs.start(peers.run_readme_worker, endpoints, sample_bytes, name="worker")
    with StudentClient(student_rank=0, slot_count=16, batch_config=config, frontend_endpoint=endpoints["frontend"],
                       control_endpoint=endpoints["control"],
                       control_pub_endpoint=endpoints["control_pub"]) as client:
        client.hello()
        client.set_model("my_model")
        dataset = DistillIterableDataset(student_rank=0, generation_value=client.generation_value,
                                         slot_count=SLOTS, batch_config=config,
                                         frontend_endpoint=endpoints["frontend"], timeout_s=30)
        samples, seen = iter(dataset), set()
        try:
            held = [next(samples) for _ in range(SLOTS // 2)]  # as many as may be lent at once
            copies = [sample["x"].clone() for sample in held]
            for sample in held:
                _check(sample, seen)
            started = time.monotonic()
            for _ in range(300):
                _check(next(samples), seen)
            assert time.monotonic() - started < 20
            for sample, copy in zip(held, copies, strict=True):  # a lent slot is never refilled
                assert torch.equal(sample["x"], copy)
            hoard = [next(samples) for _ in range(3 * SLOTS)]  # more than the pool: copies past the limit
            for sample in hoard:
                _check(sample, seen)
            def lent(group: list) -> list[bool]:
                return [not s["x"].untyped_storage().resizable() for s in group]  # views of shared memory

            # Large samples: the held ones are lent; with half the pool out on loan, copies.
            assert lent(held) == [sample_bytes >= LEND_MIN_BYTES] * len(held)
            assert not any(lent(hoard))
            del held, hoard
            loader = torch.utils.data.DataLoader(_Once(samples), batch_size=2 * SLOTS)
            batch = next(iter(loader))  # the DataLoader's collate over one sample per item
            assert batch["x"].shape == (2 * SLOTS, sample_bytes // 8)
            for row in batch["x"]:
                _check({"x": row}, seen)
            kept = next(samples)
        finally:
            samples.close()
        _check(kept, set())  # a sample kept past close() still reads (its segment is unlinked, mapped until it goes)


class _Once(torch.utils.data.IterableDataset):
    """Hands an iterator already running to a DataLoader."""

    def __init__(self, samples) -> None:
        super().__init__()
        self.samples = samples

    def __iter__(self):
        return self.samples


@contextlib.contextmanager
def _readme_dataset(endpoints: dict[str, str], config, client_slots: int) -> Iterator[DistillIterableDataset]:
    """The seed README's student (its leader client, the model set) and its dataset of
    ``SLOTS`` slots, positional arguments as the README's API lists them."""
    with StudentClient(0, client_slots, config, endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"]) as client:
        client.hello()
        client.set_model("my_model")
        yield DistillIterableDataset(0, client.generation_value, SLOTS, config, endpoints["frontend"],
                                     timeout_s=30)


def test_lent_samples_cross_a_dataloader_worker_intact(procs, endpoints) -> None:
    """A DataLoader worker pickles each lent sample into shared memory (its loan then
    ends): the batches the training process gets are exact, and the pool keeps cycling."""
    sample_bytes = 256 << 10
    config = peers.readme_config(sample_bytes)
    procs.start(peers.run_broker, endpoints, name="broker")
    procs.start(peers.run_readme_worker, endpoints, sample_bytes, name="worker")
    with _readme_dataset(endpoints, config, client_slots=2) as dataset:
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1)
        seen: set[tuple[int, int]] = set()
        for count, sample in enumerate(loader):
            _check(sample, seen)
            if count == 5 * SLOTS:
                break


def test_a_generator_returning_tensors_delivers_exact_samples_beside_a_bytes_one(procs, endpoints) -> None:
    """The generator API's fast path (tensors by name, copied straight into the slot)
    from one worker process, the seed README's bytes from another, to the README's student."""
    sample_bytes = 256 << 10
    config = peers.readme_config(sample_bytes)
    procs.start(peers.run_broker, endpoints, name="broker")
    tensors = procs.start(peers.run_tensor_worker, endpoints, sample_bytes, name="tensor-worker")
    procs.start(peers.run_readme_worker, endpoints, sample_bytes, name="bytes-worker")
    with _readme_dataset(endpoints, config, client_slots=16) as dataset:
        samples, seen = iter(dataset), set()
        started = time.monotonic()
        try:  # until the tensor worker has delivered (both share the slots, once both are up)
            while time.monotonic() - started < 20 and sum(writer == tensors.pid for writer, _ in seen) < 20:
                _check(next(samples), seen)
        finally:
            samples.close()
    assert sum(writer == tensors.pid for writer, _ in seen) >= 20, f"{len(seen)} samples, none or few from tensors"
