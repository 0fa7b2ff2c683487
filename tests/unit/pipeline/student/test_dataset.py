"""DistillIterableDataset: its typed config (and the seed README's arguments), the
settings it refuses by name, and the metadata of what it yields (fill numbers
consecutive per pool, request ids random). In-process broker and worker."""

from __future__ import annotations

import logging
import multiprocessing as mp

import pytest
import torch

from distill.pipeline import Broker, DatasetConfig, DistillIterableDataset, StudentClient, Worker
from distill.pipeline.student import dataset as dataset_module
from distill.pipeline.student.dataset import META_KEYS
from tests import peers


def test_the_seed_readme_arguments_and_a_config_object_make_the_same_dataset() -> None:
    generation = mp.Value("q", 0)
    readme = DistillIterableDataset(student_rank=0, generation_value=generation, slot_count=8,
                                    batch_config=peers.batch_config())
    configured = DistillIterableDataset(generation_value=generation, config=DatasetConfig(
        student_rank=0, slot_count=8, batch_config=peers.batch_config()))
    assert readme.config == configured.config
    assert (readme.slot_count, readme.batch_size, readme.max_retries) == (8, None, 10)
    assert "fill" in META_KEYS


def test_settings_that_cannot_work_are_refused_by_name() -> None:
    generation, config = mp.Value("q", 0), peers.batch_config()
    with pytest.raises(ValueError, match="reuse_batches=True needs batch_size"):
        DistillIterableDataset(0, generation, 4, config, reuse_batches=True)
    with pytest.raises(ValueError, match="needs generation_value"):
        DistillIterableDataset(0, None, 4, config)
    with pytest.raises(TypeError, match="bach_size.*DatasetConfig"):
        DistillIterableDataset(0, generation, 4, config, bach_size=8)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pin_memory=True needs CUDA"):
            DistillIterableDataset(0, generation, 4, config, batch_size=2, pin_memory=True)


@pytest.mark.timeout(60)
def test_batches_carry_consecutive_fill_numbers_and_random_request_ids(endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    worker = Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(),
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
                    heartbeat_interval_s=0.2).start()
    try:
        with StudentClient(0, 1, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], heartbeat_interval_s=0.2) as client:
            client.hello()
            generation = client.set_model("m")
            dataset = DistillIterableDataset(0, client.generation_value, 8, peers.batch_config(),
                                             endpoints["frontend"], batch_size=4, with_meta=True, timeout_s=20,
                                             heartbeat_interval_s=0.2)
            batches = iter(dataset)
            fills, requests = [], []
            for _ in range(10):
                batch = next(batches)
                assert set(META_KEYS) <= set(batch)
                for x, req, gen in zip(batch["x"], batch["request_id"], batch["generation"], strict=True):
                    assert int(gen) == generation and torch.equal(x, peers.expected_x(int(req), generation))
                fills += batch["fill"].tolist()
                requests += batch["request_id"].tolist()
            batches.close()
    finally:
        worker.stop()
        broker.stop()
    assert len(set(fills)) == len(fills) and min(fills) == 1
    assert max(fills) - len(fills) <= 8  # none lost: the gaps are at most the slots still in flight
    assert len(set(requests)) == len(requests)
    gaps = {b - a for a, b in zip(sorted(requests), sorted(requests)[1:], strict=False)}
    assert gaps != {1}  # not consecutive: nobody can guess the next one


@pytest.mark.timeout(60)
def test_waiting_for_samples_names_the_broker_and_its_workers(
        endpoints, broker_kwargs, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A student with a broker but no teacher worker says where it waits and that the broker
    has no worker, then gives up at ``timeout_s``."""
    monkeypatch.setattr(dataset_module, "WARN_EVERY_S", 0.3)
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.1).start()
    try:
        with StudentClient(0, 1, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], heartbeat_interval_s=0.1) as client:
            client.hello()
            client.set_model("m")
            dataset = DistillIterableDataset(0, client.generation_value, 4, peers.batch_config(),
                                             endpoints["frontend"], batch_size=2, timeout_s=2,
                                             heartbeat_interval_s=0.1)
            with caplog.at_level(logging.WARNING, logger="distill.pipeline.student.dataset"), \
                    pytest.raises(TimeoutError, match="no sample for 2s"):
                next(iter(dataset))
    finally:
        broker.stop()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting")]
    assert said, caplog.text
    assert f"from the broker at {endpoints['frontend']}, which has 0 live workers:" in said[-1]
