"""The defaults chosen from the sample size and the machine (``sizing.py``): a ring that
is a byte budget against the last-level cache, a worker batch that is a byte budget,
explicit arguments used exactly as given, and the choice said once in the log."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from distill.pipeline import (
    BatchConfig,
    DistillIterableDataset,
    StudentClient,
    TensorSpec,
    Worker,
    sizing,
)

KIB, MIB = 1 << 10, 1 << 20


def _cache_dir(tmp_path: Path, caches: list[tuple[str, str]]) -> Path:
    """A fake ``/sys/devices/system/cpu/cpu0/cache`` with (type, size) per index."""
    for i, (kind, size) in enumerate(caches):
        index = tmp_path / f"index{i}"
        index.mkdir()
        (index / "type").write_text(kind + "\n")
        (index / "size").write_text(size + "\n")
    return tmp_path


def test_the_last_level_cache_is_the_largest_data_or_unified_cache(tmp_path: Path) -> None:
    caches = _cache_dir(tmp_path, [("Data", "48K"), ("Instruction", "64M"), ("Unified", "2048K"),
                                   ("Unified", "32M")])
    assert sizing.last_level_cache_bytes(caches) == 32 * MIB  # the 64M instruction cache does not count


def test_without_sysfs_the_cache_comes_from_sysconf_or_the_fallback(tmp_path: Path, monkeypatch) -> None:
    empty = tmp_path / "none"
    monkeypatch.setattr(sizing.os, "sysconf", lambda name: 12 * MIB if name == "SC_LEVEL3_CACHE_SIZE" else -1)
    assert sizing.last_level_cache_bytes(empty) == 12 * MIB
    monkeypatch.setattr(sizing.os, "sysconf", lambda name: 0)
    assert sizing.last_level_cache_bytes(tmp_path / "none2") == sizing.FALLBACK_CACHE_BYTES


@pytest.mark.parametrize(("sample", "cache", "slots"), [
    (4 * KIB, 32 * MIB, sizing.MAX_SLOTS),   # half the cache: 4,096 slots of 4 KiB
    (2 * KIB, 8 * MIB, 2048),                # half of an 8 MiB cache
    (4 * KIB, 480 * MIB, sizing.MAX_SLOTS),  # at most MAX_SLOTS
    (256 * KIB, 32 * MIB, 64),          # 16 MiB: half a 32 MiB cache
    (256 * KIB, 480 * MIB, 128),        # a huge cache: MAX_RING_BYTES, 32 MiB
    (4 * MIB, 480 * MIB, 8),            # (the budget counts samples, not their headers)
    (4 * MIB, 32 * MIB, 4),
    (4 * MIB, 8 * MIB, sizing.MIN_SLOTS),  # a small cache: never fewer than MIN_SLOTS
    (256 * KIB, 4 * MIB, 8),            # half of a 4 MiB cache
    (16, 32 * MIB, sizing.MAX_SLOTS),   # tiny samples: capped
])
def test_the_ring_is_a_byte_budget_against_the_cache(sample: int, cache: int, slots: int) -> None:
    assert sizing.ring_slots(sample, cache) == slots


def test_no_ring_holds_more_samples_than_the_budget_past_the_minimum() -> None:
    for sample in (KIB, 4 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB):
        for cache in (32 * MIB, 480 * MIB):
            assert sizing.ring_slots(sample, cache) * sample <= sizing.MAX_RING_BYTES


@pytest.mark.parametrize(("sample", "batch"), [(4 * KIB, 64), (256 * KIB, 64), (MIB, 16), (4 * MIB, 4), (16 * MIB, 1),
                                             (64 * MIB, 1), (0, 64)])
def test_the_worker_batch_is_a_byte_budget(sample: int, batch: int) -> None:
    assert sizing.worker_batch(sample) == batch


def _config(sample: int) -> BatchConfig:
    return BatchConfig([TensorSpec("x", (sample,), "uint8")])


def test_left_out_arguments_are_chosen_and_logged_once_given_ones_are_kept(caplog, monkeypatch) -> None:
    monkeypatch.setattr(sizing, "_logged", set())
    config = _config(4 * MIB)
    chosen = sizing.ring_slots(4 * MIB)
    with caplog.at_level(logging.INFO, logger="distill.pipeline.sizing"):
        dataset = DistillIterableDataset(0, generation_value=_Value(), batch_config=config,
                                         frontend_endpoint="ipc:///nowhere/f.sock")
        assert dataset.slot_count == chosen and dataset.slot_count == chosen
        assert DistillIterableDataset(0, _Value(), 16, config).slot_count == 16  # as given, exactly
        worker = Worker(generator_fn=lambda *_: b"", slot_size=4 * MIB)
        assert worker.max_batch == 4 and worker.capacity == 8
        assert Worker(generator_fn=lambda *_: b"", slot_size=4 * MIB, max_batch=16).max_batch == 16
    said = [r.getMessage() for r in caplog.records if r.name == "distill.pipeline.sizing"]
    assert len([m for m in said if m.startswith("DistillIterableDataset: slot_count=")]) == 1, said
    assert any(m.startswith("Worker: max_batch=4 chosen for samples of 4194304 bytes") for m in said), said
    assert all("pass " in m for m in said)  # each names the argument that sets it


def test_a_ring_given_far_smaller_than_the_chosen_one_is_kept_and_warned_about_once(caplog, monkeypatch) -> None:
    monkeypatch.setattr(sizing, "_logged", set())
    monkeypatch.setattr(sizing, "last_level_cache_bytes", lambda: 32 * MIB)  # 4 KiB: 4,096 slots; 256 KiB: 64
    with caplog.at_level(logging.WARNING, logger="distill.pipeline.sizing"):
        for _ in range(2):  # the seed README's dataset, twice: one warning
            assert DistillIterableDataset(0, _Value(), 8, _config(4 * KIB)).slot_count == 8  # kept
        DistillIterableDataset(0, _Value(), 15, _config(256 * KIB))  # below a quarter of 64
        DistillIterableDataset(0, _Value(), 16, _config(256 * KIB))  # a quarter: no warning
        DistillIterableDataset(0, _Value(), 8, _config(4 * MIB))     # more than the chosen 4
        DistillIterableDataset(0, _Value(), None, _config(4 * KIB))  # chosen: said at INFO only
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(said) == 2, said
    assert said[0].startswith("DistillIterableDataset: slot_count=8 is a ring of 32 KiB for samples of 4096 bytes, "
                              "against 4096 slots (16.2 MiB)"), said[0]
    assert "Leave slot_count out" in said[0] and "slot_count=15" in said[1]


def test_a_student_client_without_slot_count_gets_the_chosen_ring(endpoints) -> None:
    config = _config(256 * KIB)
    with StudentClient(0, batch_config=config, frontend_endpoint=endpoints["frontend"],
                       control_endpoint=endpoints["control"],
                       control_pub_endpoint=endpoints["control_pub"]) as client:
        assert client._pool.config.slot_count == sizing.ring_slots(256 * KIB)
    with StudentClient(0, 5, config, endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"]) as client:
        assert client._pool.config.slot_count == 5


class _Value:
    """Stands in for ``StudentClient.generation_value`` where nothing is iterated."""

    value = 0
