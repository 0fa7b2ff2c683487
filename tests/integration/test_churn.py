"""Churn at the pipeline level: teacher workers SIGKILLed and restarted while the leader
switches models, and a broker SIGKILLed and restarted under DataLoader workers.

Every sample a rank yields is checked: intact (payload derived from its request id and
generation, ``peers.expected_x``), not older than the generation current when it was
asked for, and never yielded twice; each new generation keeps arriving.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch

from distill.pipeline import Broker, DistillIterableDataset, StudentClient, Worker, setup_logging
from tests import peers
from tests.conftest import MP

SWITCHES = 6
CHURN_EVERY_S = 0.5
LIVE_WORKERS = 2
HEARTBEAT_S = 0.2

# Workers come from a fork server that has imported torch and our code already: a
# restarted worker is serving in tens of milliseconds instead of the seconds a fresh
# interpreter needs on a loaded 2-core machine (and the fork server itself has no
# threads or sockets, so forking it is safe).
FORKSERVER = mp.get_context("forkserver")
FORKSERVER.set_forkserver_preload(["torch", "zmq", "tests.peers"])


def _check_batch(batch: dict[str, torch.Tensor], seen: set[tuple[int, int, int]]) -> tuple[int, int]:
    """(corrupt, duplicate) samples in a batch with metadata; ``seen`` grows."""
    corrupt = duplicates = 0
    for x, tag, gen, req, src in zip(batch["x"], batch["tag"], batch["generation"], batch["request_id"],
                                     batch["source"], strict=True):
        key = (int(src), int(req), int(gen))
        duplicates += key in seen
        seen.add(key)
        corrupt += not (torch.equal(x, peers.expected_x(int(req), int(gen)))
                        and tag.tolist() == [int(req), int(gen)])
    return corrupt, duplicates


def run_churn_rank(rank: int, world: int, init_file: str, endpoints: dict[str, str], switches: int,
                   results) -> None:
    """A DDP rank (rank 0 leads) that switches ``switches`` times and checks every sample."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    setup_logging("WARNING")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    config = peers.batch_config()
    client = StudentClient(rank, 4, config, endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], heartbeat_interval_s=HEARTBEAT_S)
    client.hello()
    if rank != 0:
        client.start_sub_listener()
    inner = DistillIterableDataset(rank, client.generation_value, 16, config, endpoints["frontend"],
                                   batch_size=4, with_meta=True, timeout_s=60,
                                   heartbeat_interval_s=HEARTBEAT_S)
    loader = iter(DataLoader(peers.FloorCheckingDataset(inner), batch_size=None, num_workers=2))
    seen: set[tuple[int, int, int]] = set()
    report = {"rank": rank, "violations": 0, "corrupt": 0, "duplicates": 0, "current_batches": 0}
    for switch in range(switches):
        gen = torch.tensor([0])
        if rank == 0:
            gen[0] = client.set_model(f"layer_{switch}", {"delay_s": 0.002})
        dist.broadcast(gen, src=0)
        generation = int(gen[0])
        if rank != 0:
            client.wait_generation(generation)
        current = 0
        while current < 3:  # the new generation keeps arriving through the churn
            batch = next(loader)
            report["violations"] += int((batch["generation"] < batch["floor"]).sum())
            corrupt, duplicates = _check_batch(batch, seen)
            report["corrupt"] += corrupt
            report["duplicates"] += duplicates
            current += bool((batch["generation"] == generation).all())
        report["current_batches"] += current
        dist.barrier()
    report["generation"] = client.generation
    results.put(report)
    del loader
    client.close()
    dist.destroy_process_group()


class WorkerChurn:
    """Keeps ``live`` workers running; every ``every_s`` SIGKILLs the oldest and starts another."""

    def __init__(self, endpoints: dict[str, str], live: int, every_s: float) -> None:
        self.endpoints = endpoints
        self.every_s = every_s
        self.kills = 0
        self.workers = [self._start() for _ in range(live)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="churn", daemon=True)

    def _start(self) -> mp.Process:
        proc = FORKSERVER.Process(target=peers.run_worker, args=(self.endpoints,),
                                  kwargs={"max_batch": 4, "heartbeat_interval_s": HEARTBEAT_S})
        proc.start()
        return proc

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            oldest = self.workers.pop(0)
            os.kill(oldest.pid, signal.SIGKILL)
            oldest.join(5)
            self.kills += 1
            self.workers.append(self._start())

    def start(self) -> WorkerChurn:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for proc in self.workers:
            proc.kill()
            proc.join(5)


@pytest.mark.timeout(240)
def test_switching_while_workers_die_and_restart(procs, endpoints, broker_kwargs, tmp_path) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=HEARTBEAT_S,
                    # the run is read after its students left: kept longer than the
                    # test's teardown (its 2 s default grace at this heartbeat, under load)
                    run_grace_s=120).start()
    churn = WorkerChurn(endpoints, LIVE_WORKERS, CHURN_EVERY_S).start()
    try:
        results = MP.Queue()
        init_file = str(tmp_path / "dist_init")
        ranks = [procs.start(run_churn_rank, rank, 2, init_file, endpoints, SWITCHES, results,
                             name=f"rank{rank}") for rank in range(2)]
        reports = procs.collect(results, 2, ranks, timeout_s=180)
        kills = churn.kills
        for proc in ranks:
            procs.join(proc, 60)
    finally:
        churn.stop()
    for report in reports:
        assert report["violations"] == 0, report
        assert report["corrupt"] == 0, report
        assert report["duplicates"] == 0, report
        assert report["generation"] == SWITCHES, report
    assert kills >= 2, f"only {kills} worker(s) killed while switching: the churn did not overlap"
    stats = broker.stats
    assert stats.per_run["default"]["generation"] == SWITCHES
    assert stats.failed == 0
    broker.stop()


def run_restart_student(endpoints: dict[str, str], before: int, after: int, results, restarted) -> None:
    """The leader consumes through 2 DataLoader workers; it never calls request_sample
    itself, like the app's rank 0 (only the datasets' pools see the broker restart)."""
    from torch.utils.data import DataLoader

    setup_logging("WARNING")
    config = peers.batch_config()
    with StudentClient(0, 1, config, endpoints["frontend"], endpoints["control"], endpoints["control_pub"],
                       heartbeat_interval_s=HEARTBEAT_S) as client:
        client.hello()
        generation = client.set_model("layer_1")
        dataset = DistillIterableDataset(0, client.generation_value, 8, config, endpoints["frontend"],
                                         batch_size=4, with_meta=True, timeout_s=30,
                                         heartbeat_interval_s=HEARTBEAT_S)
        loader = iter(DataLoader(dataset, batch_size=None, num_workers=2))
        seen: set[tuple[int, int, int]] = set()
        report = {"corrupt": 0, "duplicates": 0, "wrong_generation": 0}
        for phase, count in (("before", before), ("after", after)):
            got = 0
            while got < count:
                batch = next(loader)
                corrupt, duplicates = _check_batch(batch, seen)
                report["corrupt"] += corrupt
                report["duplicates"] += duplicates
                report["wrong_generation"] += int((batch["generation"] != generation).sum())
                got += len(batch["x"])
            results.put(phase)
            if phase == "before":
                restarted.wait(60)
        report["generation"] = client.generation
        results.put(report)
        del loader


@pytest.mark.timeout(120)
def test_broker_restart_under_dataloader_workers(procs, endpoints) -> None:
    """The leader's model and generation come back on a restarted broker although only
    the DataLoader workers' pools, not the leader's client, are asking for samples."""
    broker = procs.start(peers.run_broker, endpoints, HEARTBEAT_S, name="broker")
    procs.start(peers.run_worker, endpoints, name="worker", heartbeat_interval_s=HEARTBEAT_S)
    results, restarted = MP.Queue(), MP.Event()
    student = procs.start(run_restart_student, endpoints, 40, 80, results, restarted, name="student")
    assert procs.collect(results, 1, [student, broker], timeout_s=60) == ["before"]
    os.kill(broker.pid, signal.SIGKILL)
    broker.join(10)
    procs.start(peers.run_broker, endpoints, HEARTBEAT_S, name="broker2")
    restarted.set()
    after, report = procs.collect(results, 2, [student], timeout_s=60)
    procs.join(student, 30)
    assert after == "after"
    assert report == {"corrupt": 0, "duplicates": 0, "wrong_generation": 0, "generation": 1}


@pytest.mark.timeout(120)
def test_broker_killed_before_a_new_pool_heard_from_it(procs, endpoints) -> None:
    """A pool sends its first REQUEST and the broker dies before any heartbeat of the
    pool was answered: the pool must still tell the restarted broker from the dead one
    (it learns the broker's instance before its first REQUEST) and ask again."""
    broker = procs.start(peers.run_broker, endpoints, HEARTBEAT_S, name="broker")
    config = peers.batch_config()
    with StudentClient(0, 1, config, endpoints["frontend"], endpoints["control"], endpoints["control_pub"],
                       heartbeat_interval_s=HEARTBEAT_S) as client:
        client.hello()
        generation = client.set_model("layer_0")
        dataset = DistillIterableDataset(0, client.generation_value, 4, config, endpoints["frontend"],
                                         with_meta=True, timeout_s=30, heartbeat_interval_s=2.0)
        got: list = []
        reader = threading.Thread(target=lambda: got.append(next(iter(dataset))), daemon=True)
        reader.start()  # no worker yet: its requests stay queued on this broker
        time.sleep(0.5)
        os.kill(broker.pid, signal.SIGKILL)
        broker.join(10)
        procs.start(peers.run_broker, endpoints, HEARTBEAT_S, name="broker2")
        procs.start(peers.run_worker, endpoints, name="worker", heartbeat_interval_s=HEARTBEAT_S)
        reader.join(60)
        assert got, "the pool never asked the restarted broker again"
        sample = got[0]
        assert int(sample["generation"]) == generation
        assert torch.equal(sample["x"], peers.expected_x(int(sample["request_id"]), generation))


@pytest.mark.timeout(60)
def test_requests_sent_while_the_broker_is_down_are_not_doubled(endpoints, broker_kwargs) -> None:
    broker = Broker(**broker_kwargs, heartbeat_interval_s=HEARTBEAT_S).start()
    worker = Worker(batch_fn=peers.fill_targets, batch_config=peers.batch_config(),
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
                    heartbeat_interval_s=HEARTBEAT_S).start()
    try:
        with StudentClient(0, 8, peers.batch_config(), endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"], heartbeat_interval_s=HEARTBEAT_S) as client:
            client.hello()
            generation = client.set_model("m")
            held = [client.request_sample(timeout_ms=20_000) for _ in range(8)]
            broker.stop()
            for ref in held:
                client.release_slot(ref.slot_id)
            client._pool.flush()  # these REQUESTs wait in the socket for the next broker
            broker = Broker(**broker_kwargs, heartbeat_interval_s=HEARTBEAT_S).start()
            for _ in range(40):
                ref = client.request_sample(timeout_ms=20_000)
                assert ref is not None and ref.generation == generation
                client.release_slot(ref.slot_id)
            doubled = client._pool.counts["rejected"]  # completions of a request asked for again
    finally:
        worker.stop()
        broker.stop()
    assert doubled == 0, f"{doubled} slot(s) were filled twice after the broker restarted"
