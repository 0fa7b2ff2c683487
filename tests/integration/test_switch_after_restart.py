"""Group 11 of issue 21: a model switch right after a broker restart is not lost.

Three worker processes, a broker process, and a student that reads through the seed
README's StudentClient + DistillIterableDataset. The run is at layer 2 when the broker
is SIGKILLed and started again; half a second later the leader switches to layer 3.
Every one of the next 500 samples must be layer 3's (``x[0]`` is the layer a sample
was made for) and of the generation ``set_model`` returned: training a layer on another
layer's targets, silently, is the worst this pipeline could do.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from distill.pipeline import DistillIterableDataset, StudentClient
from tests import peers

SAMPLES_AFTER = 500


def _layers(batches, count: int, generation: int) -> tuple[set[int], set[int]]:
    """The layers and generations of the next ``count`` samples, checked byte for byte."""
    layers, generations = set(), set()
    got = 0
    while got < count:
        batch = next(batches)
        for x, req, gen in zip(batch["x"], batch["request_id"], batch["generation"], strict=True):
            expected = peers.expected_x(int(req), int(gen))
            assert bool((x[1:] == expected[1:]).all()), "a torn or foreign sample"
            layers.add(int(x[0]))
            generations.add(int(gen))
            got += 1
    return layers, generations


@pytest.mark.timeout(120)
def test_a_switch_half_a_second_after_a_broker_restart_reaches_every_sample(procs, endpoints) -> None:
    broker = procs.start(peers.run_broker, endpoints, name="broker")
    for n in range(3):
        procs.start(peers.run_layer_worker, endpoints, name=f"worker{n}")
    with StudentClient(0, 8, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"], heartbeat_interval_s=0.2) as client:
        client.hello()
        dataset = DistillIterableDataset(0, client.generation_value, 16, peers.batch_config(),
                                         endpoints["frontend"], batch_size=8, with_meta=True, timeout_s=30,
                                         heartbeat_interval_s=0.2)
        batches = iter(dataset)
        try:
            for layer in (1, 2):
                generation = client.set_model(f"layer_{layer}", {"layer": layer})
                assert _layers(batches, 40, generation) == ({layer}, {generation})
            os.kill(broker.pid, signal.SIGKILL)
            broker.join(10)
            procs.start(peers.run_broker, endpoints, name="broker2")
            time.sleep(0.5)
            generation = client.set_model("layer_3", {"layer": 3})
            layers, generations = _layers(batches, SAMPLES_AFTER, generation)
            assert layers == {3}, f"samples of layer(s) {sorted(layers - {3})} yielded after the switch to 3"
            assert generations == {generation}
        finally:
            batches.close()
