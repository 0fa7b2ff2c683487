"""Broker memory under load: resident set size over a sustained run and during a flood.

Why: the broker is the one process every sample's address goes through; if any of
its tables (queues, in-flight work, peers, rate windows) grew with the number of
samples served, a long distillation run would end in an out-of-memory kill. This
prints, for a broker process (``distill.pipeline.Broker``):

1. ``sustained``: 2 worker processes fill 256 KiB slots as fast as a student (this
   process, ``DistillIterableDataset(batch_size=32, reuse_batches=True)``) takes
   them, for ``--seconds``. The broker's RSS is sampled every 0.5 s; the table
   shows it after warm-up, at its peak and at the end, the samples served, and the
   least-squares slope in KiB per minute (flat: within noise of 0).
2. ``flood``: a peer sends REQUESTs of 1,000 slots each as fast as it can, with no
   worker to serve them, for ``--flood-seconds`` (the broker refuses what exceeds
   its per-run queue bound and answers ERROR), then leaves (BYE). RSS before, peak
   during, and after the flood's requests were dropped.
3. ``fairness``: what each attack of issue 37 (``bench/attacks.py``: floods of dear bodies,
   unread HELLOs, STATS over 1,000 runs, a queue hog of another run, made-up runs) costs a
   good student. One worker and one student (this process, a ``StudentClient`` of 32 slots
   of 4 KiB, direct requests off: every sample goes through the broker; its run's
   ``model_cfg`` is 60 KB) take samples in ``--rounds`` pairs of ``--fair-seconds``
   windows per attack, one quiet and one while the attacker (its own process, reading no
   answer) sends. Printed, one row per attack: the student's samples/s (median) quiet and
   attacked and their ratio, the broker's peak RSS, the longest a STATS (asked every
   0.25 s) waited, the attack's messages.

4. ``--e2e``: peak RSS of the end-to-end stage's student rank on a random-weights Llama of
   about 1B parameters (hidden 2048, 16 layers, vocabulary 32k, bfloat16, all 16 layers
   replaced by float32 ``ResidualMLP(hidden_mult=0.25)``, trainable=replacements), on CPU:
   teacher loaded, student built, ``--e2e-steps`` AdamW steps on random top-32 targets,
   the stage's weights saved. ``before`` is main before issue 22 (the spliced student a
   deep copy of the teacher, the KL on the full [B, T, V] logits, every tensor cloned at
   save), rebuilt here from the same parts; ``after`` is ``distill.train.e2e`` as it is.
   Each cell runs in a fresh process (its own high-water mark, VmHWM), at 1024 and 4096
   tokens per step (micro-batches of 2 and 8 chunks of 512).

5. ``--checkpointing``: peak RSS of training steps of an exported student with and without
   ``activation_checkpointing_enable()`` (``bench/checkpoint_memory.py``). A mixed student of a
   random-weights Llama (hidden 512, 8 layers, vocab 8192; layers 0-2 linear attention, sliding
   window + linear, gated linear attention, 4-5 a token-wise MLP and a pruned layer, 6 linear
   attention, 3 and 7 the teacher's softmax attention), exported and loaded back with
   ``load_student``; batch 2 x 1024 tokens, float32, next-token cross-entropy. Each cell runs
   in a fresh process: after loading, its high-water mark is reset (``/proc/self/clear_refs``),
   then 3 forward + backward steps; its peak is ``ru_maxrss`` after them (so neither the other
   cell nor the load counts). Printed: RSS before the steps, the peak, the peak above the RSS
   before, the median step after the first, the on/off ratios, and the largest difference
   between the two cells' gradients (exit code 1 above 1e-4).

Run it from the repository root::

    python bench/memory.py            # 60 s sustained + 10 s flood + 5 attacks x 2 x (4 + 4) s fairness
    python bench/memory.py --quick    # 10 s + 3 s + 5 x 2 x (2 + 2) s
    python bench/memory.py --only-fairness   # the attacks alone (issue 37's table in docs/security.md)
    python bench/memory.py --e2e      # the end-to-end stage, before / after (about 5 minutes)
    python bench/memory.py --checkpointing   # activation checkpointing off / on (about 40 s)
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import zmq
from attacks import ATTACKS, BIG_MODEL_CFG, run_attacker  # bench/attacks.py
from checkpoint_memory import checkpointing_main  # bench/checkpoint_memory.py
from children import SPAWN, Children, child_init, run_broker  # bench/children.py
from pipeline import fill_targets, run_worker, sample_config  # bench/pipeline.py
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from distill.model.assemble import splice
from distill.model.teacher import Teacher
from distill.pipeline import DistillIterableDataset, StudentClient, Worker, protocol
from distill.pipeline.protocol import Command
from distill.replacements.mlp import ResidualMLP
from distill.train import checkpoint as ckpt
from distill.train.e2e import E2EStudent, topk_kl

SAMPLE_BYTES = 256 << 10
BATCH, SLOTS, WORKER_BATCH = 32, 128, 32
SAMPLE_EVERY_S = 0.5
FLOOD_SLOTS_PER_REQUEST = 1000
FAIR_SAMPLE_BYTES, FAIR_SLOTS, FAIR_WORKER_BATCH = 4096, 32, 16
STATS_EVERY_S = 0.25


@dataclass
class Trace:
    """RSS samples (seconds since start, KiB) of one process over one phase."""

    name: str
    times_s: list[float]
    rss_kib: list[int]
    served: int = 0

    @property
    def slope_kib_per_min(self) -> float:
        n = len(self.times_s)
        if n < 2:
            return 0.0
        mean_t, mean_r = sum(self.times_s) / n, sum(self.rss_kib) / n
        var = sum((t - mean_t) ** 2 for t in self.times_s)
        cov = sum((t - mean_t) * (r - mean_r) for t, r in zip(self.times_s, self.rss_kib, strict=True))
        return cov / var * 60 if var else 0.0


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def sustained(endpoints: dict[str, str], broker_pid: int, seconds: float) -> Trace:
    """Two workers, one student taking batches as fast as they come; broker RSS sampled."""
    config = sample_config(SAMPLE_BYTES)
    trace = Trace("sustained", [], [])
    with Children() as kids, StudentClient(0, 1, config, endpoints["frontend"], endpoints["control"],
                                           endpoints["control_pub"]) as client:
        for _ in range(2):
            kids.start(run_worker, endpoints, SAMPLE_BYTES, WORKER_BATCH)
        client.hello()
        client.set_model("memory")
        dataset = DistillIterableDataset(0, client.generation_value, SLOTS, config, endpoints["frontend"],
                                         batch_size=BATCH, timeout_s=60, reuse_batches=True)
        batches = iter(dataset)
        try:
            warm_until = time.monotonic() + min(5.0, seconds / 5)
            while time.monotonic() < warm_until:
                next(batches)
            start = next_sample = time.monotonic()
            while (now := time.monotonic()) - start < seconds:
                if now >= next_sample:
                    trace.times_s.append(now - start)
                    trace.rss_kib.append(rss_kib(broker_pid))
                    next_sample += SAMPLE_EVERY_S
                next(batches)
                trace.served += BATCH
        finally:
            batches.close()
    return trace


def flood(endpoints: dict[str, str], broker_pid: int, seconds: float) -> Trace:
    """REQUESTs of many slots as fast as possible, nobody to serve them; then BYE."""
    trace = Trace("flood", [0.0], [rss_kib(broker_pid)])
    ctx = zmq.Context()
    sock = protocol.configure(ctx.socket(zmq.DEALER))
    peer_id = f"flood-{os.getpid()}"
    sock.setsockopt(zmq.ROUTING_ID, peer_id.encode())
    sock.connect(endpoints["frontend"])
    medium = f"dst_flood_{os.getpid()}_0"  # never mapped: no worker runs in this phase
    start = next_sample = time.monotonic()
    request_id = 0
    try:
        while (now := time.monotonic()) - start < seconds:
            slots = [[i, request_id + i] for i in range(FLOOD_SLOTS_PER_REQUEST)]
            request_id += FLOOD_SLOTS_PER_REQUEST
            protocol.send(sock, Command.REQUEST, {"run_id": "flood", "peer_id": peer_id, "generation": 0,
                                                  "medium": medium, "stride": 4096, "slots": slots})
            trace.served += FLOOD_SLOTS_PER_REQUEST
            while sock.poll(0):
                sock.recv_multipart()  # ERROR replies once the queue is full
            if now >= next_sample:
                trace.times_s.append(now - start)
                trace.rss_kib.append(rss_kib(broker_pid))
                next_sample += SAMPLE_EVERY_S
        protocol.send(sock, Command.BYE, {"peer_id": peer_id})
        time.sleep(2.0)  # the broker drains its socket and drops the requests
        trace.times_s.append(time.monotonic() - start)
        trace.rss_kib.append(rss_kib(broker_pid))
    finally:
        sock.close(linger=0)
        ctx.term()
    return trace


@dataclass
class Window:
    """The good student's samples/s in one window, and what the broker showed meanwhile."""

    samples_per_s: float
    rss_kib: int
    stats_wait_s: float


@dataclass
class Fairness:
    """Per attack (``attacks.ATTACKS``): the quiet windows before its own, its windows, and
    the messages it sent."""

    quiet: dict[str, list[Window]] = field(default_factory=dict)
    attacked: dict[str, list[Window]] = field(default_factory=dict)
    sent: dict[str, int] = field(default_factory=dict)


def run_fair_worker(parent_pid: int, ready, endpoints: dict[str, str]) -> None:
    """A worker whose every fill goes through the broker (no direct requests)."""
    child_init(parent_pid)
    worker = Worker(batch_fn=fill_targets, batch_config=sample_config(FAIR_SAMPLE_BYTES), max_batch=FAIR_WORKER_BATCH,
                    backend_endpoint=endpoints["backend"], control_pub_endpoint=endpoints["control_pub"],
                    direct_requests=False)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    ready.set()
    worker.run()


def fairness(endpoints: dict[str, str], broker_pid: int, seconds: float, rounds: int,
             attacks: tuple[str, ...] = ATTACKS) -> Fairness:
    """For each attack, quiet and attacked windows in turn (see the module docstring)."""
    result = Fairness()
    with Children() as kids, StudentClient(0, FAIR_SLOTS, sample_config(FAIR_SAMPLE_BYTES), endpoints["frontend"],
                                           endpoints["control"], endpoints["control_pub"],
                                           direct_requests=False) as client:
        kids.start(run_fair_worker, endpoints)
        client.hello()
        client.set_model("fairness", BIG_MODEL_CFG)
        _window(client, 1.0, endpoints, broker_pid)  # warm up
        for attack in attacks:
            on, sent = SPAWN.Event(), SPAWN.Value("q", 0)
            kids.start(run_attacker, attack, endpoints, on, sent)
            quiet, attacked = result.quiet.setdefault(attack, []), result.attacked.setdefault(attack, [])
            for _ in range(rounds):
                quiet.append(_window(client, seconds, endpoints, broker_pid))
                on.set()
                time.sleep(1.0)  # the attack is on before the window opens
                attacked.append(_window(client, seconds, endpoints, broker_pid))
                on.clear()
                time.sleep(1.0)  # what the attacker had queued drains
            result.sent[attack] = sent.value
    return result


def _window(client: StudentClient, seconds: float, endpoints: dict[str, str], broker_pid: int) -> Window:
    """Samples for ``seconds``; the broker's peak RSS and longest STATS wait meanwhile."""
    count, start, next_stats = 0, time.monotonic(), 0.0
    rss, waits = [rss_kib(broker_pid)], [0.0]
    while (now := time.monotonic()) - start < seconds:
        if now >= next_stats:
            waits.append(_stats_wait_s(endpoints["frontend"]))
            rss.append(rss_kib(broker_pid))
            next_stats = time.monotonic() + STATS_EVERY_S
        ref = client.request_sample(timeout_ms=60_000)
        if ref is None:
            raise RuntimeError("the good student got no sample for 60 s")
        client.release_slot(ref.slot_id)
        count += 1
    return Window(count / (time.monotonic() - start), max(rss), max(waits))


def _stats_wait_s(frontend: str, timeout_s: float = 60.0) -> float:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(frontend)
    try:
        started = time.monotonic()
        protocol.send(sock, Command.STATS, {})
        if not sock.poll(timeout_s * 1000):
            return float("inf")
        sock.recv_multipart()
        return time.monotonic() - started
    finally:
        sock.close(0)


def print_fairness(result: Fairness, seconds: float) -> None:
    """One row per attack: the student's median samples/s quiet and attacked, their ratio,
    the broker's peak RSS and the longest STATS wait in the attacked windows."""
    print(f"\nfairness: a good student through the broker ({FAIR_SLOTS} slots of {FAIR_SAMPLE_BYTES >> 10} KiB, "
          f"1 worker, run model_cfg {len(BIG_MODEL_CFG['blob']) // 1000} KB), {seconds:g} s windows, quiet then "
          "attacked, per attack")
    print(f"{'attack':<8} {'quiet/s':>9} {'attacked/s':>11} {'lowest':>8} {'vs quiet':>9} {'broker MiB':>11} "
          f"{'STATS wait':>11} {'sent':>11}")
    for attack, attacked in result.attacked.items():
        quiet = statistics.median(w.samples_per_s for w in result.quiet[attack])
        under = statistics.median(w.samples_per_s for w in attacked)
        print(f"{attack:<8} {quiet:>9,.0f} {under:>11,.0f} {min(w.samples_per_s for w in attacked):>8,.0f} "
              f"{under / quiet:>9.2f} {max(w.rss_kib for w in attacked) / 1024:>11.1f} "
              f"{max(w.stats_wait_s for w in attacked) * 1000:>9.1f}ms {result.sent[attack]:>11,}")


def print_trace(trace: Trace, unit: str) -> None:
    rss = trace.rss_kib
    print(f"{trace.name:<10} {len(rss):>7} {rss[0] / 1024:>10.1f} {max(rss) / 1024:>9.1f} "
          f"{rss[-1] / 1024:>9.1f} {trace.slope_kib_per_min:>12.1f} {trace.served:>14,} {unit}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="10 s sustained, 3 s flood")
    parser.add_argument("--seconds", type=float, default=None, help="sustained phase (default 60)")
    parser.add_argument("--flood-seconds", type=float, default=None, help="flood phase (default 10)")
    parser.add_argument("--e2e", action="store_true", help="the end-to-end stage's peak RSS, before / after")
    parser.add_argument("--e2e-steps", type=int, default=2, help="training steps per end-to-end cell")
    parser.add_argument("--e2e-layers", type=int, default=E2E_LAYERS, help="teacher layers (16: ~1B parameters)")
    parser.add_argument("--checkpointing", action="store_true", help="an exported student's training step, with "
                        "and without activation checkpointing")
    parser.add_argument("--fair-seconds", type=float, default=None, help="each fairness window (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="quiet/attacked window pairs per attack (default 2)")
    parser.add_argument("--only-fairness", action="store_true", help="skip the sustained and flood phases")
    parser.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS), help="fairness attacks to run")
    args = parser.parse_args(argv)
    if args.e2e:
        return e2e_main(args.e2e_steps, args.e2e_layers)
    if args.checkpointing:
        return checkpointing_main()
    seconds = args.seconds or (10.0 if args.quick else 60.0)
    flood_s = args.flood_seconds or (3.0 if args.quick else 10.0)
    fair_s = args.fair_seconds or (2.0 if args.quick else 4.0)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    logging.getLogger("distill").setLevel(logging.ERROR)  # the flood's refusals are expected
    sock_dir = tempfile.mkdtemp(prefix="distill-mem-")
    endpoints = {name: f"ipc://{sock_dir}/{name}.sock" for name in ("frontend", "backend", "control",
                                                                   "control_pub")}
    try:
        with Children() as shared:
            broker_pid = shared.start(run_broker, endpoints)
            traces = [] if args.only_fairness else [
                (sustained(endpoints, broker_pid, seconds), "samples served"),
                (flood(endpoints, broker_pid, flood_s), "slots requested")]
            fair = fairness(endpoints, broker_pid, fair_s, args.rounds, tuple(args.attacks))
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    print(f"distill broker memory: {os.cpu_count()} CPUs, {SAMPLE_BYTES >> 10} KiB samples, "
          f"RSS sampled every {SAMPLE_EVERY_S} s, load average {os.getloadavg()[0]:.1f}")
    if traces:
        print(f"{'phase':<10} {'samples':>7} {'first MiB':>10} {'peak MiB':>9} {'last MiB':>9} "
              f"{'KiB/min':>12} {'count':>14}")
    for trace, unit in traces:
        print_trace(trace, unit)
    print_fairness(fair, fair_s)
    return 0


# ---------------------------------------------------------------------- --e2e

E2E_HIDDEN, E2E_LAYERS, E2E_VOCAB, E2E_SEQ, E2E_TOP_K = 2048, 16, 32000, 512, 32
E2E_BATCHES = (2, 8)
"""Micro-batch sizes (chunks of E2E_SEQ tokens) of the end-to-end cells."""
GIB = 2**30


def e2e_teacher_dir(directory: str, num_layers: int) -> str:
    """A random-weights Llama of about 1B parameters (16 layers) saved in bfloat16."""
    config = LlamaConfig(vocab_size=E2E_VOCAB, hidden_size=E2E_HIDDEN, intermediate_size=5632,
                         num_hidden_layers=num_layers, num_attention_heads=16, num_key_value_heads=16,
                         max_position_embeddings=E2E_SEQ, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(directory)
    del model
    return f"{params / 1e9:.2f}B parameters"


def hwm_gib() -> float:
    """This process's peak resident set size (VmHWM) so far."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / GIB
    raise RuntimeError("no VmHWM")


def _e2e_cell(teacher_dir: str, variant: str, batch: int, steps: int, save_dir: str, results) -> None:
    """One cell in a fresh process: load, build, train, save; the high-water mark after each."""
    torch.set_num_threads(os.cpu_count() or 1)
    marks = {}
    teacher = Teacher.from_pretrained(teacher_dir, dtype="bfloat16")
    marks["teacher loaded"] = hwm_gib()
    torch.manual_seed(1)
    replacements = {idx: ResidualMLP(teacher, idx, hidden_mult=0.25).float() for idx in range(teacher.num_layers)}
    student = (BeforeStudent if variant == "before" else E2EStudent)(teacher, replacements, "replacements")
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=1e-4)
    marks["student built"] = hwm_gib()
    gen = torch.Generator().manual_seed(2)
    started = time.monotonic()
    for _ in range(steps):
        ids_BT = torch.randint(0, E2E_VOCAB, (batch, E2E_SEQ), generator=gen)
        # what a worker sends: K log-probabilities (descending) and their token ids per token
        logp_BTK = torch.randn(batch, E2E_SEQ, E2E_TOP_K, generator=gen).sort(-1, descending=True).values - 3.0
        idx_BTK = torch.randint(0, E2E_VOCAB, (batch, E2E_SEQ, E2E_TOP_K), generator=gen)
        loss, _ = student(ids_BT, logp_BTK, idx_BTK)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del logp_BTK, idx_BTK, loss
    marks["training steps"] = hwm_gib()
    step_s = (time.monotonic() - started) / steps
    if variant == "before":  # main's _contiguous cloned every tensor before writing
        save_file({k: v.detach().contiguous().clone() for k, v in student.state_dict().items()},
                  os.path.join(save_dir, f"{variant}{batch}.safetensors"))
    else:
        ckpt.save_stage_weights(Path(save_dir), batch, student)
    marks["weights saved"] = hwm_gib()
    results.put({"variant": variant, "batch": batch, "marks": marks, "step_s": step_s})


class BeforeStudent(E2EStudent):
    """The end-to-end student as main had it before issue 22: a deep copy of the teacher (all
    but the replaced layers) and the KL on the full logits (``topk_kl`` of [B*T, V])."""

    def __init__(self, teacher: Teacher, replacements: dict, trainable: str) -> None:
        super().__init__(teacher, replacements, trainable)
        self.model = splice(teacher, replacements).requires_grad_(False)  # the deep copy
        for replacement in replacements.values():
            replacement.requires_grad_(True)

    def forward(self, ids_BT: torch.Tensor, logp_BTK: torch.Tensor, idx_BTK: torch.Tensor):
        final_BTD = self.final_hidden(ids_BT)
        logits_BTV = self.logits(final_BTD)
        return topk_kl(logits_BTV.flatten(0, 1), logp_BTK.flatten(0, 1), idx_BTK.flatten(0, 1), 1.0), final_BTD


def e2e_main(steps: int, num_layers: int) -> int:
    """Every (variant, batch) cell in its own process, then one table."""
    work = tempfile.mkdtemp(prefix="distill-e2e-mem-")
    rows = []
    try:
        described = e2e_teacher_dir(os.path.join(work, "teacher"), num_layers)
        for batch in E2E_BATCHES:
            for variant in ("before", "after"):
                results = SPAWN.Queue()
                proc = SPAWN.Process(target=_e2e_cell, args=(os.path.join(work, "teacher"), variant, batch,
                                                              steps, work, results))
                proc.start()
                rows.append(results.get(timeout=3600))
                proc.join(60)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"end-to-end stage peak RSS (VmHWM, GiB): random Llama {described} (hidden {E2E_HIDDEN}, "
          f"{num_layers} layers, vocab {E2E_VOCAB}, bf16), trainable=replacements ({num_layers} float32 MLPs), "
          f"{steps} AdamW steps, {os.cpu_count()} CPUs")
    phases = list(rows[0]["marks"])
    print(f"{'tokens/step':>11} {'variant':<7} " + " ".join(f"{p:>15}" for p in phases) + f" {'s/step':>7}")
    for row in rows:
        print(f"{row['batch'] * E2E_SEQ:>11} {row['variant']:<7} "
              + " ".join(f"{row['marks'][p]:>15.2f}" for p in phases) + f" {row['step_s']:>7.1f}")
    for batch in E2E_BATCHES:
        before, after = ([r for r in rows if r["batch"] == batch and r["variant"] == v][0] for v in ("before", "after"))
        over = {v: r["marks"]["weights saved"] - r["marks"]["teacher loaded"] for v, r in (("before", before), ("after", after))}
        print(f"{batch * E2E_SEQ} tokens: stage peak above the loaded teacher {over['before']:.2f} -> "
              f"{over['after']:.2f} GiB ({over['after'] / over['before']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
