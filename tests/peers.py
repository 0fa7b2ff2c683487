"""Process entry points for multi-process tests (module-level so spawn can import them).

Payloads are derived from the request they answer, so a consumer can verify every
byte it is handed: ``expected_payload(request_id, generation)``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.utils.data

from distill.pipeline import BatchConfig, Broker, SlotTarget, TensorSpec, Worker, setup_logging
from distill.pipeline.auth import CurveConfig

PAYLOAD_FLOATS = 256


def batch_config(floats: int = PAYLOAD_FLOATS) -> BatchConfig:
    return BatchConfig([TensorSpec("x", (floats,), "float32"), TensorSpec("tag", (2,), "int64")])


def expected_x(request_id: int, generation: int, floats: int = PAYLOAD_FLOATS) -> torch.Tensor:
    base = float((request_id * 7919 + generation * 104729) % 1_000_003)
    return torch.arange(floats, dtype=torch.float32) + base


def fill_targets(model_id: str, model_cfg: dict | None, targets: list[SlotTarget]) -> None:
    """The zero-copy batch function: writes a request-derived payload into each slot."""
    delay = float((model_cfg or {}).get("delay_s", 0.0))
    if delay:
        time.sleep(delay)
    for target in targets:
        floats = target.tensors["x"].numel()
        target.tensors["x"].copy_(expected_x(target.request_id, target.generation, floats))
        target.tensors["tag"].copy_(torch.tensor([target.request_id, target.generation]))


def consume_verified(client, generation: int, count: int, *, seen: set[int] | None = None,
                     timeout_ms: float = 30_000, what: str = "no sample") -> set[int]:
    """Take and release samples until ``count`` distinct request ids were seen, each of
    ``generation`` and checked byte for byte against its request id; none twice."""
    seen = set() if seen is None else seen
    while len(seen) < count:
        ref = take_verified(client, generation, seen, timeout_ms=timeout_ms, what=what)
        client.release_slot(ref.slot_id)
    return seen


def take_verified(client, generation: int, seen: set[int], *, timeout_ms: float = 30_000,
                  what: str = "no sample"):
    """One sample (not released: the caller does), of ``generation``, checked byte for byte
    against its request id and never seen before; its request id joins ``seen``."""
    ref = client.request_sample(timeout_ms=timeout_ms)
    assert ref is not None, f"{what} (after {len(seen)} samples)"
    assert ref.generation == generation
    assert torch.equal(ref.tensors["x"], expected_x(ref.request_id, generation)), \
        f"slot {ref.slot_id} (request {ref.request_id}) holds a torn or foreign sample"
    assert ref.request_id not in seen, f"request {ref.request_id} yielded twice"
    seen.add(ref.request_id)
    return ref


def run_segment_owner() -> None:
    """A consumer pool (segment + notice inbox) that waits to be killed, never closing them."""
    from distill.pipeline import SlotPool

    pool = SlotPool("ipc:///nonexistent/frontend.sock", "owner", 2, 4096, lambda: 0, lambda _: None)
    time.sleep(120)
    pool.close()


def run_squatted_student(endpoints: dict[str, str], pids, go, results, samples: int = 20) -> None:
    """Say its pid and wait for ``go`` (a squatter plants files in /dev/shm meanwhile),
    then start a StudentClient of the run "default", take ``samples`` verified samples and
    report its segment's name."""
    from distill.pipeline import StudentClient

    setup_logging("WARNING")
    pids.put(os.getpid())
    if not go.wait(60):
        return
    with StudentClient(0, 8, batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"], heartbeat_interval_s=0.2) as client:
        client.hello()
        generation = client.set_model("squatted")
        consume_verified(client, generation, samples)
        results.put(client._pool.medium.buf_name)


def run_broker(endpoints: dict[str, str], heartbeat_interval_s: float = 0.2) -> None:
    setup_logging("WARNING")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    Broker(**{f"{k}_endpoint": v for k, v in endpoints.items()},
           heartbeat_interval_s=heartbeat_interval_s).run()


def run_late_broker(endpoints: dict[str, str], delay_s: float, heartbeat_interval_s: float = 0.2) -> None:
    """A broker whose process runs ``delay_s`` before it serves (one importing torch on a loaded
    machine took minutes)."""
    time.sleep(delay_s)
    run_broker(endpoints, heartbeat_interval_s)


def run_worker(endpoints: dict[str, str], floats: int = PAYLOAD_FLOATS, max_batch: int = 16,
               heartbeat_interval_s: float = 0.2, local_shm: bool = True,
               curve: CurveConfig | None = None, direct_requests: bool = True) -> None:
    setup_logging("WARNING")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    Worker(batch_fn=fill_targets, batch_config=batch_config(floats), max_batch=max_batch,
           backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
           heartbeat_interval_s=heartbeat_interval_s, local_shm=local_shm, curve=curve,
           direct_requests=direct_requests).run()


def run_sleeping_worker(endpoints: dict[str, str], delay_s: float, max_batch: int = 4,
                        heartbeat_interval_s: float = 0.2, per_sample: bool = False) -> None:
    """A teacher-like worker: each batch sleeps ``delay_s`` (``per_sample``: that much per
    slot of the batch, a GPU that is saturated) before it writes the request-derived
    payloads; a GPU forward costs the host no CPU."""
    setup_logging("WARNING")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    def fill(model_id: str, model_cfg: dict | None, targets: list[SlotTarget]) -> None:
        time.sleep(delay_s * len(targets) if per_sample else delay_s)
        fill_targets(model_id, None, targets)

    Worker(batch_fn=fill, batch_config=batch_config(), max_batch=max_batch,
           backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
           heartbeat_interval_s=heartbeat_interval_s).run()


def run_student(endpoints: dict[str, str], rank: int, num_samples: int, results, *,
                leader: bool, batch_size: int | None, num_workers: int = 2,
                slot_count: int = 32, curve: CurveConfig | None = None) -> None:
    """Consume ``num_samples`` verified samples through a DataLoader; report counts."""
    from torch.utils.data import DataLoader

    from distill.pipeline import DistillIterableDataset, StudentClient

    setup_logging("WARNING")
    config = batch_config()
    with StudentClient(rank, 4, config, endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"], curve=curve) as client:
        client.hello()
        if leader:
            client.set_model("m0")
        else:
            client.start_sub_listener()
            client.wait_generation(1)
        dataset = DistillIterableDataset(rank, client.generation_value, slot_count, config,
                                         endpoints["frontend"], batch_size=batch_size, with_meta=True,
                                         timeout_s=60, curve=curve)
        loader = DataLoader(dataset, batch_size=None if batch_size else 8, num_workers=num_workers)
        seen: set[tuple[int, int]] = set()
        fills: dict[int, list[int]] = {}
        corrupt = duplicates = 0
        for batch in loader:
            for x, tag, gen, req, src, fill in zip(batch["x"], batch["tag"], batch["generation"],
                                                   batch["request_id"], batch["source"], batch["fill"], strict=True):
                key = (int(src), int(req))
                duplicates += key in seen
                seen.add(key)
                fills.setdefault(int(src), []).append(int(fill))
                ok = torch.equal(x, expected_x(int(req), int(gen))) and tag.tolist() == [int(req), int(gen)]
                corrupt += not ok
            if len(seen) >= num_samples:
                break
        # Fill numbers of a pool are consecutive (its request ids are random): a gap not
        # explained by slots still in flight at the end would be a lost sample.
        gaps = sum(max(f) - min(f) + 1 - len(set(f)) for f in fills.values())
        per_source = fills
        results.put({"rank": rank, "samples": len(seen), "corrupt": corrupt, "duplicates": duplicates,
                     "gaps": gaps, "sources": len(per_source)})
        del loader


class FloorCheckingDataset(torch.utils.data.IterableDataset):
    """Wraps a DistillIterableDataset: reads the shared generation *before* asking for
    each item and attaches it as ``floor``; an item older than its floor was yielded
    after a newer generation had been published to this process."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner

    def __iter__(self):
        it = iter(self.inner)
        while True:
            floor = self.inner.generation_value.value
            item = next(it)
            item["floor"] = torch.tensor(floor)
            yield item


def run_switch_rank(rank: int, world: int, init_file: str, endpoints: dict[str, str], switches: int,
                    results) -> None:
    """A DDP rank that switches the model ``switches`` times under load (rank 0 leads)."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from distill.pipeline import DistillIterableDataset, StudentClient

    setup_logging("WARNING")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    config = batch_config()
    client = StudentClient(rank, 4, config, endpoints["frontend"], endpoints["control"],
                           endpoints["control_pub"])
    client.hello()
    if rank != 0:
        client.start_sub_listener()
    inner = DistillIterableDataset(rank, client.generation_value, 24, config, endpoints["frontend"],
                                   batch_size=8, with_meta=True, timeout_s=60)
    loader = iter(DataLoader(FloorCheckingDataset(inner), batch_size=None, num_workers=2))
    violations = corrupt = prefetched_stale = 0
    for switch in range(switches):
        gen = torch.tensor([0])
        if rank == 0:
            gen[0] = client.set_model(f"layer_{switch}", {"delay_s": 0.003})
        dist.broadcast(gen, src=0)
        generation = int(gen[0])
        if rank != 0:
            client.wait_generation(generation)
        assert client.generation >= generation
        current = 0
        while current < 3:  # no slot stays stuck: the new generation keeps arriving
            batch = next(loader)
            violations += int((batch["generation"] < batch["floor"]).sum())
            for x, req, g in zip(batch["x"], batch["request_id"], batch["generation"], strict=True):
                corrupt += not torch.equal(x, expected_x(int(req), int(g)))
            if bool((batch["generation"] == generation).all()):
                current += 1
            elif bool((batch["generation"] < generation).any()):
                prefetched_stale += 1  # yielded before the switch, still in the DataLoader queue
        dist.barrier()
    results.put({"rank": rank, "violations": violations, "corrupt": corrupt,
                 "prefetched_stale": prefetched_stale, "generation": client.generation})
    del loader
    client.close()
    dist.destroy_process_group()


def announce(path: str, text: str) -> None:
    """Write ``text`` to ``path`` at once: a test that waits for the file to exist reads it
    whole (written in place, it could read it empty, as one did on a loaded machine)."""
    staged = f"{path}.{os.getpid()}.tmp"
    Path(staged).write_text(text)
    os.replace(staged, path)


def run_freezing_worker(endpoints: dict[str, str], busy_file: str, heartbeat_interval_s: float = 0.2) -> None:
    """A worker that announces its first batch in ``busy_file`` and then hangs in it."""
    setup_logging("WARNING")

    def hang(model_id: str, model_cfg: dict | None, targets: list[SlotTarget]) -> None:
        announce(busy_file, str(len(targets)))
        time.sleep(600)

    Worker(batch_fn=hang, batch_config=batch_config(), backend_endpoint=endpoints["backend"],
           control_pub_endpoint=endpoints["control_pub"], heartbeat_interval_s=heartbeat_interval_s).run()


def run_zombie_worker(endpoints: dict[str, str], mid_write_file: str, heartbeat_interval_s: float = 0.2) -> None:
    """A worker whose first batch writes half of each slot, announces it in
    ``mid_write_file`` (the test freezes it there with SIGSTOP), then writes the
    rest. What that batch writes is wrong (``-1``), so any of it that reaches a sample
    a student yields is caught by ``expected_x``; later batches are correct."""
    setup_logging("WARNING")

    def torn(model_id: str, model_cfg: dict | None, targets: list[SlotTarget]) -> None:
        if os.path.exists(mid_write_file):
            fill_targets(model_id, model_cfg, targets)
            return
        for target in targets:
            x = target.tensors["x"]
            x[: x.numel() // 2] = -1.0
        announce(mid_write_file, str(len(targets)))
        time.sleep(2.0)  # frozen here; the sleep's deadline has passed when it resumes
        for target in targets:
            x = target.tensors["x"]
            x[x.numel() // 2:] = -1.0
            target.tensors["tag"].copy_(torch.tensor([target.request_id, target.generation]))
        with open(mid_write_file + ".written", "w") as f:
            f.write("late writes done")

    Worker(batch_fn=torn, batch_config=batch_config(), backend_endpoint=endpoints["backend"],
           control_pub_endpoint=endpoints["control_pub"], heartbeat_interval_s=heartbeat_interval_s).run()


def fill_layer_targets(model_id: str, model_cfg: dict | None, targets: list[SlotTarget]) -> None:
    """Like ``fill_targets``, and ``x[0]`` is the layer the run asked for (its model)."""
    fill_targets(model_id, model_cfg, targets)
    for target in targets:
        target.tensors["x"][0] = float((model_cfg or {})["layer"])


def run_layer_worker(endpoints: dict[str, str], max_batch: int = 8, heartbeat_interval_s: float = 0.2) -> None:
    setup_logging("WARNING")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    Worker(batch_fn=fill_layer_targets, batch_config=batch_config(), max_batch=max_batch,
           backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
           heartbeat_interval_s=heartbeat_interval_s).run()


def run_layer_student(endpoints: dict[str, str], run_id: str, layers: list[int], samples_per_layer: int,
                      results) -> None:
    """One run (a sweep job): leads its own model switches, one per layer, and checks that
    every sample is of its run's current layer and generation, byte for byte."""
    from distill.pipeline import StudentClient

    setup_logging("WARNING")
    with StudentClient(0, 16, batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"], run_id=run_id, heartbeat_interval_s=0.2) as client:
        client.hello()
        foreign = corrupt = 0
        generations = []
        for layer in layers:
            generation = client.set_model(f"layer_{layer}", {"layer": layer})
            generations.append(generation)
            for _ in range(samples_per_layer):
                ref = client.request_sample(timeout_ms=30_000)
                if ref is None:
                    raise TimeoutError(f"run {run_id}: no sample for layer {layer}")
                x = ref.tensors["x"]
                foreign += int(x[0]) != layer or ref.generation != generation
                corrupt += not torch.equal(x[1:], expected_x(ref.request_id, ref.generation)[1:])
                client.release_slot(ref.slot_id)
        results.put({"run_id": run_id, "foreign": foreign, "corrupt": corrupt, "generations": generations,
                     "counts": dict(client._pool.counts)})
def run_limited_broker(endpoints: dict[str, str], limits: dict[str, int],
                       heartbeat_interval_s: float = 0.2) -> None:
    """A broker with back-pressure limits of its own (``max_*`` keywords of Broker)."""
    setup_logging("ERROR")  # a flood's refusals are expected: keep the test output readable
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    Broker(**{f"{k}_endpoint": v for k, v in endpoints.items()},
           heartbeat_interval_s=heartbeat_interval_s, **limits).run()


def run_sharing_student(endpoints: dict[str, str], run_id: str, layers: list[int], samples_per_layer: int,
                        results, start, *, fan_out: bool, delay_s: float = 0.01,
                        seconds: float | None = None) -> None:
    """One run of a sweep that may share samples with other runs of the same model
    (fan-out). A shared sample was made for another slot, maybe of another run, so its
    payload is checked against its own tag (the request id and generation it was made
    for), and its header against this run's slot: own request id, this run's current
    generation. Reports the tags seen (which samples were computed for whom).
    With ``seconds``, counts what arrives in that window instead of a fixed number."""
    from distill.pipeline import StudentClient

    setup_logging("WARNING")
    with StudentClient(0, 16, batch_config(), endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"], run_id=run_id, heartbeat_interval_s=0.2,
                       fan_out=fan_out) as client:
        client.hello()
        foreign = corrupt = 0
        tags: list[int] = []
        generations = []
        for n, layer in enumerate(layers):
            generations.append(client.set_model(f"layer_{layer}", {"layer": layer, "delay_s": delay_s}))
            if n == 0:
                start.wait(60)  # every run of the test asks from the same moment on
            deadline = time.monotonic() + seconds if seconds else None
            got = 0
            while (deadline is None and got < samples_per_layer) or (deadline and time.monotonic() < deadline):
                ref = client.request_sample(timeout_ms=30_000)
                if ref is None:
                    raise TimeoutError(f"run {run_id}: no sample for layer {layer}")
                x, (made_for, made_gen) = ref.tensors["x"], ref.tensors["tag"].tolist()
                foreign += int(x[0]) != layer or ref.generation != generations[-1]
                corrupt += not torch.equal(x[1:], expected_x(made_for, made_gen)[1:])
                tags.append(made_for)
                got += 1
                client.release_slot(ref.slot_id)
        results.put({"run_id": run_id, "foreign": foreign, "corrupt": corrupt, "generations": generations,
                     "tags": tags, "counts": dict(client._pool.counts)})


def run_slow_writer(endpoints: dict[str, str], mid_file: str, pause_s: float,
                    heartbeat_interval_s: float = 0.2) -> None:
    """A worker that writes the first half of each sample, announces its first batch in
    ``mid_file``, pauses ``pause_s`` (that batch only), writes the second half and then
    ``mid_file + ".done"``. Every value of ``x`` is the worker's pid: a sample written by
    two workers shows two values (a non-deterministic teacher's torn sample)."""
    setup_logging("WARNING")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    mine = float(os.getpid())

    def slow(model_id: str, model_cfg: dict | None, targets: list[SlotTarget]) -> None:
        first = not os.path.exists(mid_file)
        for target in targets:
            x = target.tensors["x"]
            x[: x.numel() // 2] = mine
        if first:
            announce(mid_file, str(len(targets)))
            time.sleep(pause_s)
        for target in targets:
            x = target.tensors["x"]
            x[x.numel() // 2:] = mine
            target.tensors["tag"].copy_(torch.tensor([target.request_id, target.generation]))
        if first:
            with open(mid_file + ".done", "w") as f:
                f.write("second half written")

    Worker(batch_fn=slow, batch_config=batch_config(), backend_endpoint=endpoints["backend"],
           control_pub_endpoint=endpoints["control_pub"], heartbeat_interval_s=heartbeat_interval_s).run()


def readme_config(sample_bytes: int) -> BatchConfig:
    """A sample of ``sample_bytes`` as int64 words: [writer pid, counter, counter, ...]."""
    return BatchConfig([TensorSpec("x", (sample_bytes // 8,), "int64")])


def run_readme_worker(endpoints: dict[str, str], sample_bytes: int) -> None:
    """The seed README's worker: a ``generator_fn`` returning each sample's bytes, every
    other argument at its default. Each sample names its writer and its number, and is
    that number throughout, so a consumer can tell a torn or overwritten one."""
    setup_logging("WARNING")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    config = readme_config(sample_bytes)
    counter = [0]

    def generate(model_id: str, model_cfg: dict | None) -> bytes:
        counter[0] += 1
        x = torch.full((sample_bytes // 8,), counter[0], dtype=torch.int64)
        x[0] = os.getpid()
        return config.encode(x=x)

    Worker(generator_fn=generate, slot_size=config.nbytes(), backend_endpoint=endpoints["backend"],
           control_pub_endpoint=endpoints["control_pub"]).run()


def run_tensor_worker(endpoints: dict[str, str], sample_bytes: int) -> None:
    """:func:`run_readme_worker`'s samples returned as tensors by name (the generator
    API's fast path: no ``encode``), with ``batch_config`` in place of ``slot_size``."""
    setup_logging("WARNING")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    config = readme_config(sample_bytes)
    counter = [0]

    def generate(model_id: str, model_cfg: dict | None) -> dict[str, torch.Tensor]:
        counter[0] += 1
        x = torch.full((sample_bytes // 8,), counter[0], dtype=torch.int64)
        x[0] = os.getpid()
        return {"x": x}

    Worker(generator_fn=generate, batch_config=config, backend_endpoint=endpoints["backend"],
           control_pub_endpoint=endpoints["control_pub"]).run()


def run_dropped_clients(endpoints: dict[str, str], refused_run: str, welcomed_run: str, results, done) -> None:
    """Two StudentClients dropped without close(): one whose HELLO the broker refuses, one
    it welcomes. Then one garbage collection, in a thread of its own bounded at 10 s: puts
    what the refused HELLO raised and how long the collection took (None: it never ended).
    Stays alive until ``done`` (the test watches the broker forget the dropped clients)."""
    import gc
    import threading

    from distill.pipeline import StudentClient

    setup_logging("ERROR")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

    def drop(run_id: str) -> str:
        client = StudentClient(0, 2, batch_config(), endpoints["frontend"], endpoints["control"],
                               endpoints["control_pub"], run_id=run_id, heartbeat_interval_s=0.2,
                               broker_wait_s=3.0)
        try:
            client.hello()
        except Exception as exc:  # noqa: BLE001 (reported to the test, which judges it)
            return f"{type(exc).__name__}: {exc}"
        return "welcomed"

    gc.collect()
    gc.disable()  # the pools are in reference cycles: only the collection below frees them
    outcomes = [drop(refused_run), drop(welcomed_run)]
    took: list[float] = []

    def collect() -> None:
        started = time.monotonic()
        gc.collect()
        took.append(time.monotonic() - started)

    collector = threading.Thread(target=collect, name="collector", daemon=True)
    collector.start()
    collector.join(10)
    results.put({"outcomes": outcomes, "gc_s": took[0] if took else None})
    done.wait(60)


def run_hanging_worker(endpoints: dict[str, str], hang_after: int, busy_file: str,
                       direct_requests: bool = False, heartbeat_interval_s: float = 0.2) -> None:
    """A worker whose first ``hang_after`` batches are quick and whose next one never
    returns (it writes its batch's size to ``busy_file`` first)."""
    setup_logging("WARNING")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    batches = [0]

    def batch_fn(model_id: str, model_cfg: dict | None, targets: list[SlotTarget]) -> None:
        batches[0] += 1
        if batches[0] > hang_after:
            announce(busy_file, str(len(targets)))
            time.sleep(600)
        fill_targets(model_id, model_cfg, targets)

    Worker(batch_fn=batch_fn, batch_config=batch_config(), max_batch=2, direct_requests=direct_requests,
           backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
           heartbeat_interval_s=heartbeat_interval_s).run()


def run_pacing_worker(endpoints: dict[str, str], delay_s: float, sample_bytes: int = 1024) -> None:
    """The seed README's worker (``generator_fn``, every other argument at its default)
    whose teacher takes ``delay_s`` per sample without using the host's CPU (a sleep, as
    a GPU forward would); each sample's first word is the worker's pid, so a consumer can
    tell which worker filled it."""
    setup_logging("WARNING")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    config = readme_config(sample_bytes)

    def generate(model_id: str, model_cfg: dict | None) -> bytes:
        time.sleep(delay_s)
        x = torch.zeros(sample_bytes // 8, dtype=torch.int64)
        x[0] = os.getpid()
        return config.encode(x=x)

    Worker(generator_fn=generate, slot_size=config.nbytes(), backend_endpoint=endpoints["backend"],
           control_pub_endpoint=endpoints["control_pub"]).run()


def run_cfg_echo_worker(endpoints: dict[str, str], max_configs: int) -> None:
    """The seed README's worker whose samples are their model_cfg's ``tag`` (every word),
    keeping at most ``max_configs`` model configs (``worker/cfgs.py``): with fewer than the
    runs it serves, every switch between them makes it ask the broker for a config again."""
    from distill.pipeline.worker import cfgs

    setup_logging("WARNING")
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    cfgs.MAX_CONFIGS = max_configs
    config = readme_config(1024)

    def generate(model_id: str, model_cfg: dict | None) -> bytes:
        assert model_cfg is not None, f"no model_cfg for {model_id}"
        return config.encode(x=torch.full((128,), model_cfg["tag"], dtype=torch.int64))

    Worker(generator_fn=generate, slot_size=config.nbytes(), backend_endpoint=endpoints["backend"],
           control_pub_endpoint=endpoints["control_pub"]).run()
