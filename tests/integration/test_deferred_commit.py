"""A batch function that leaves its copies in flight (the CUDA worker's shape) over real
sockets and shared memory: the worker finishes each batch exactly once, after it has
started the next one when one is waiting, and before the slot's header is written.

The batch function writes the payload only in ``finish``: a worker that said DONE
before finishing would hand the student zeros (counted as corrupt) or unwritten
headers (refused, so filled again: more fills completed than samples delivered).
"""

from __future__ import annotations

import threading

import pytest
import torch

from distill.pipeline import Broker, DistillIterableDataset, SlotTarget, StudentClient, Worker
from distill.train.transfer import DevicePrefetcher
from tests import peers

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


class DeferredFill:
    """Returns a finish callable per batch; records the order of starts and finishes."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.batches = 0

    def __call__(self, model_id: str, model_cfg: dict | None, targets: list[SlotTarget]):
        with self.lock:
            batch = self.batches
            self.batches += 1
            self.events.append(("start", batch))
        for target in targets:
            target.tensors["x"].zero_()

        def finish() -> None:
            peers.fill_targets(model_id, model_cfg, targets)
            with self.lock:
                self.events.append(("finish", batch))

        return finish


@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", DEVICES)
def test_deferred_batches_are_finished_once_before_commit_and_overlap(endpoints, broker_kwargs,
                                                                      device: str) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    fill = DeferredFill()
    worker = Worker(batch_fn=fill, batch_config=peers.batch_config(), max_batch=8,
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
                    heartbeat_interval_s=0.2).start()
    config = peers.batch_config()
    corrupt = seen = 0
    try:
        with StudentClient(0, 4, config, endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"]) as client:
            client.hello()
            generation = client.set_model("deferred")
            dataset = DistillIterableDataset(0, client.generation_value, 32, config, endpoints["frontend"],
                                             batch_size=8, with_meta=True, timeout_s=60,
                                             pin_memory=device == "cuda")
            batches = iter(dataset)
            try:
                for batch in DevicePrefetcher(batches, device):
                    assert batch["x"].device.type == device
                    for x, req in zip(batch["x"].cpu(), batch["request_id"].tolist(), strict=True):
                        corrupt += not torch.equal(x, peers.expected_x(req, generation))
                    seen += len(batch["x"])
                    if seen >= 800:
                        break
            finally:
                batches.close()
    finally:
        worker.stop()
        broker.stop()
    assert corrupt == 0 and seen >= 800
    starts = [b for kind, b in fill.events if kind == "start"]
    finishes = [b for kind, b in fill.events if kind == "finish"]
    assert sorted(finishes) == starts == list(range(fill.batches))  # each batch finished exactly once
    overlapped = sum(fill.events.index(("start", b + 1)) < fill.events.index(("finish", b))
                     for b in range(fill.batches - 1))
    assert overlapped > 0, "no batch was started while the previous one was still in flight"
    assert broker.stats.failed == 0
    # a slot whose header was not yet written when the student looked is refused and
    # filled again: beyond the slots in flight at the end, every fill was delivered
    assert broker.stats.completed <= seen + 32 + 8, broker.stats
