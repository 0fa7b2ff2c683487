"""The network medium over loopback: workers that cannot map the student's shared
memory send the samples over TCP; workers that can keep writing into it directly."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from distill.pipeline import Broker, DistillIterableDataset, StudentClient, protocol
from distill.pipeline.mediums.tcp import PLAIN_USER, parse_medium, plain_password
from tests import peers

LOOPBACK = "127.0.0.1"


def _client(endpoints: dict[str, str], slots: int = 32) -> StudentClient:
    return StudentClient(0, slots, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                         endpoints["control_pub"], heartbeat_interval_s=0.2, medium="tcp",
                         tcp_host=LOOPBACK)


def _wait_for_workers(broker: Broker, count: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while broker.stats.workers < count:
        assert time.monotonic() < deadline, f"{broker.stats.workers}/{count} workers joined in {timeout_s}s"
        time.sleep(0.05)


@pytest.mark.timeout(90)
def test_a_worker_that_cannot_map_the_segment_sends_every_sample_over_tcp(procs, endpoints,
                                                                         broker_kwargs) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    procs.start(peers.run_worker, endpoints, name="remote", local_shm=False)
    with _client(endpoints) as client:
        client.hello()
        generation = client.set_model("m")
        peers.consume_verified(client, generation, 300)
        medium = client._pool.medium
        assert parse_medium(medium.buf_name).endpoint.startswith(f"tcp://{LOOPBACK}:")
        assert medium.counts["received"] >= 300  # every sample came through the data socket
    broker.stop()


@pytest.mark.timeout(90)
def test_shared_memory_and_tcp_workers_fill_one_student(procs, endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    procs.start(peers.run_worker, endpoints, name="local", max_batch=4)
    procs.start(peers.run_worker, endpoints, name="remote", max_batch=4, local_shm=False)
    _wait_for_workers(broker, 2)
    with _client(endpoints) as client:
        client.hello()
        generation = client.set_model("m")
        peers.consume_verified(client, generation, 600)
        received, accepted = client._pool.medium.counts["received"], client._pool.counts["accepted"]
    broker.stop()
    assert 0 < received < accepted, f"{received} of {accepted} samples over tcp: both paths must serve"


@pytest.mark.timeout(90)
def test_a_dataset_on_the_network_medium_yields_exact_batches(procs, endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    procs.start(peers.run_worker, endpoints, name="remote", local_shm=False)
    with _client(endpoints, slots=1) as client:
        client.hello()
        generation = client.set_model("m")
        dataset = DistillIterableDataset(0, client.generation_value, 32, peers.batch_config(),
                                         endpoints["frontend"], batch_size=8, with_meta=True,
                                         timeout_s=30, medium="tcp", tcp_host=LOOPBACK)
        batches = iter(dataset)
        for _ in range(20):
            batch = next(batches)
            for x, req, gen in zip(batch["x"], batch["request_id"], batch["generation"], strict=True):
                assert int(gen) == generation
                assert torch.equal(x, peers.expected_x(int(req), generation))
        batches.close()
    broker.stop()


@pytest.mark.timeout(90)
def test_forged_and_malformed_data_is_dropped(procs, endpoints, broker_kwargs) -> None:
    """A peer without the medium's key is not heard at all; one with it (a buggy worker)
    cannot write outside a slot, or into a slot that does not wait for exactly that
    request, or stop the student."""
    broker = Broker(**broker_kwargs, heartbeat_interval_s=0.2).start()
    procs.start(peers.run_worker, endpoints, name="remote", local_shm=False)
    with _client(endpoints) as client:
        client.hello()
        generation = client.set_model("m")
        medium = client._pool.medium
        stride = medium.slot_stride
        address = parse_medium(medium.buf_name)
        ctx = zmq.Context.instance()
        stranger = ctx.socket(zmq.PUSH)
        stranger.connect(address.endpoint)
        keyed = ctx.socket(zmq.PUSH)
        keyed.plain_username, keyed.plain_password = PLAIN_USER.encode(), plain_password(address.data_key)
        keyed.connect(address.endpoint)
        junk = bytes(stride)
        forged = [
            protocol.encode_data(generation, stride, [[10_000, 1]], [memoryview(junk)]),  # no such slot
            protocol.encode_data(generation, stride, [[0, 12345]], [memoryview(junk)]),  # not its request
            protocol.encode_data(generation, stride, [[0, 1]], [memoryview(junk[:-1])]),  # short frame
            protocol.encode_data(generation, stride + 64, [[0, 1]], [memoryview(junk + bytes(64))]),
            protocol.encode_data(generation, stride, [[0, 1], [1, 2]], [memoryview(junk)]),  # frame missing
            [b"garbage"],
        ]
        for frames in forged:
            stranger.send_multipart(frames)
            keyed.send_multipart(frames)
        peers.consume_verified(client, generation, 200)
        assert medium.counts["dropped"] == len(forged)  # the keyed peer's, each once; the stranger's never came
        stranger.close(linger=0)
        keyed.close(linger=0)
    broker.stop()
