"""Defaults that depend on the sample size: a student's ring and a worker's batch.

An argument left out (``slot_count=None``, ``max_batch=None``) is chosen from the
sample's bytes (``BatchConfig.nbytes()``) and the machine's last-level cache, and the
choice is logged once per process at INFO:

- the ring: ``RING_CACHE_FRACTION`` of the last-level cache, at most ``MAX_RING_BYTES``
  (the cache is shared by every rank and DataLoader worker of the node), in slots,
  between ``MIN_SLOTS`` and ``MAX_SLOTS``;
- a worker's batch: ``WORKER_BATCH_BYTES`` of samples per call of the sample function,
  between 1 and ``MAX_WORKER_BATCH`` slots.

Arguments given explicitly are used exactly as given; a ring given smaller than
1 / ``SMALL_RING_FRACTION`` of the one distill would choose is used, with one warning.
The resulting sizes: docs/pipeline.md, section The Python API; why a count of slots is
the wrong unit: docs/benchmarks.md, section Direct requests by ring size.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from distill.pipeline.batch import BatchConfig
from distill.pipeline.slot import slot_stride

log = logging.getLogger(__name__)

CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
FALLBACK_CACHE_BYTES = 32 << 20
"""The last-level cache assumed where neither sysfs nor ``sysconf`` says (a server's L3)."""
RING_CACHE_FRACTION = 0.5
"""A ring's share of the last-level cache: the student's batch and everything else the
processes touch need the rest."""
MAX_RING_BYTES = 32 << 20
"""A ring's bytes at most, however large the cache says it is. Measured best on a machine
with a 32 MiB-class L3: 8 MiB of 4 KiB samples, 32 MiB of 256 KiB, 12 MiB of 4 MiB; on
one whose L3 reads 480 MiB (a VM's share of it is less), one ``batch_fn`` worker: 256 KiB
samples 29.5k samples/s with 63 slots, 32.5k with 128 (32 MiB), 24.6k with 192; 4 MiB
samples 2.0k with 3 slots, 2.3k with 4, 2.5k with 6-8 (32 MiB), bimodal from 12 up
(1.4-2.7k). Past 32 MiB the worker's writes stop finding the ring in cache."""
MIN_SLOTS, MAX_SLOTS = 3, 4096
"""At least one slot being filled, one being read and one ready; at most what a REQUEST
carries comfortably."""
WORKER_BATCH_BYTES = MAX_RING_BYTES // 2
"""Samples per call of a worker's sample function, in bytes: half the largest ring, so
two workers' batches fit in it at once. Measured on the 2-core machine with the README's
``generator_fn`` worker and one student: 256 KiB samples, 2 workers, 26-29k samples/s
with 16 slots a batch, 33-34k with 32 or 64 (the workers spending 33, 29 and 26 us of CPU
a sample); 4 MiB samples, 1 worker, 1.5k with 1 slot a batch, 1.7k with 2, 1.85k with 4
(a ``batch_fn`` worker 2.55-2.6k with each). A batch larger than a student's fair share
of its ring is claimed a share at a time (``worker/fill.py``)."""
MAX_WORKER_BATCH = 64
SMALL_RING_FRACTION = 4
"""A ``slot_count`` given below 1/this of the ring distill would choose is warned about
(once). Measured with one README worker (``docs/benchmarks.md``): 8 slots instead of the
chosen ring ran 4 KiB samples at 0.13 and 256 KiB at 0.44 of the tuned path; 63 slots of
256 KiB instead of 128 lost only a tenth, so half the chosen ring is not worth a warning."""

_logged: set[tuple[str, int, int]] = set()


@functools.lru_cache(maxsize=4)
def last_level_cache_bytes(cache_dir: Path = CACHE_DIR) -> int:
    """The largest data or unified cache of CPU 0 (sysfs, then ``sysconf``, then
    ``FALLBACK_CACHE_BYTES``)."""
    sizes = []
    for index in sorted(cache_dir.glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            size = _parse_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if kind in ("Data", "Unified") and size > 0:
            sizes.append(size)
    if sizes:
        return max(sizes)
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            size = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if size > 0:
            return size
    return FALLBACK_CACHE_BYTES


def _parse_size(text: str) -> int:
    """sysfs cache sizes: ``"2048K"``, ``"32M"``, or plain bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


def ring_slots(sample_bytes: int, cache_bytes: int | None = None) -> int:
    """Slots for a student's ring of samples of ``sample_bytes``. The budget counts the
    samples, not their 64-byte headers: 8 slots of 4 MiB fill a 32 MiB budget (counting
    headers gave 7, and 7 slots ran 5% slower than 8, ``MAX_RING_BYTES``)."""
    cache = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    budget = min(MAX_RING_BYTES, int(cache * RING_CACHE_FRACTION))
    return max(MIN_SLOTS, min(MAX_SLOTS, budget // max(1, sample_bytes)))


def worker_batch(sample_bytes: int) -> int:
    """Slots per call of a worker's sample function, for samples of ``sample_bytes``."""
    return max(1, min(MAX_WORKER_BATCH, WORKER_BATCH_BYTES // max(1, sample_bytes)))


def chosen_slots(who: str, config: BatchConfig) -> int:
    """``slot_count`` left out: the ring for samples of ``config``, logged once."""
    stride = slot_stride(config.nbytes())
    cache = last_level_cache_bytes()
    chosen = ring_slots(config.nbytes(), cache)
    log_choice(who, "slot_count", chosen, config.nbytes(),
               f"a ring of {chosen * stride / (1 << 20):.1f} MiB: {RING_CACHE_FRACTION:g} of the "
               f"{cache >> 20} MiB last-level cache, at most {MAX_RING_BYTES >> 20} MiB, "
               f"{MIN_SLOTS}-{MAX_SLOTS} slots")
    return chosen


def check_given_slots(who: str, given: int, config: BatchConfig) -> None:
    """Warn once if ``given`` slots are far fewer than the ring distill would choose for
    samples of ``config``: a ring that small makes the workers wait on a round trip every
    few samples. The user's number is kept (it may bound memory or how many samples are in
    flight on purpose); the warning says what it costs and how to choose otherwise."""
    sample_bytes = config.nbytes()
    chosen = ring_slots(sample_bytes)
    if given * SMALL_RING_FRACTION >= chosen or not _first_time((f"{who}.small_ring", given, sample_bytes)):
        return
    stride = slot_stride(sample_bytes)
    log.warning("%s: slot_count=%d is a ring of %s for samples of %d bytes, against %d slots (%s) "
                "distill would choose: workers will wait on a round trip every few samples. Leave "
                "slot_count out to have it chosen, or raise it", who, given, _size(given * stride),
                sample_bytes, chosen, _size(chosen * stride))


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes / (1 << 10):.0f} KiB"


def log_choice(who: str, what: str, value: int, sample_bytes: int, why: str) -> None:
    """Say once per process (and per kind of choice and sample size) what was chosen."""
    if not _first_time((f"{who}.{what}", value, sample_bytes)):
        return
    log.info("%s: %s=%d chosen for samples of %d bytes (%s); pass %s= to set it", who, what, value,
             sample_bytes, why, what)


def _first_time(key: tuple[str, int, int]) -> bool:
    """Whether this process has not said ``key`` yet (and from now on, has)."""
    if key in _logged:
        return False
    _logged.add(key)
    return True
