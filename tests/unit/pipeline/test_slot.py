"""The slot header: the vectorised table functions against the one-slot reference, and
the HeaderTable's one-slot-at-a-time path against the vectorised functions."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from distill.pipeline import BatchConfig, TensorSpec
from distill.pipeline.batch import LARGE_ROW_BYTES, copy_rows
from distill.pipeline.slot import (
    FEW_SLOTS,
    HEADER_BYTES,
    HeaderTable,
    SlotHeader,
    check_slot,
    check_slots,
    clear_header,
    clear_headers,
    header_table,
    payload_checksum,
    read_claim,
    read_header,
    slot_stride,
    write_claim,
    write_header,
    write_headers,
)

PAYLOAD = 40
STRIDE = slot_stride(PAYLOAD)
SLOTS = 16
WRITER = 0x1234_5678_0001


def _segment() -> memoryview:
    return memoryview(bytearray(SLOTS * STRIDE))


def test_stride_is_aligned_and_holds_header_and_payload() -> None:
    for payload in (0, 1, 63, 64, 65, 4096):
        stride = slot_stride(payload)
        assert stride % 64 == 0 and stride >= HEADER_BYTES + payload


def _random_headers(rng: random.Random, with_checksums: bool) -> tuple[list[int], int, list[int], list[int],
                                                                      list[int] | None]:
    """Slots, generation, request ids, payload lengths and checksums for one write."""
    slots = rng.sample(range(SLOTS), rng.randint(1, SLOTS))
    return (slots, rng.randrange(2**63), [rng.randrange(2**63) for _ in slots],
            [rng.randrange(PAYLOAD + 1) for _ in slots],
            [rng.randrange(2**32) for _ in slots] if with_checksums else None)


def test_write_headers_matches_write_header_byte_for_byte() -> None:
    rng = random.Random(0)
    for trial in range(50):
        slots, generation, reqs, lens, checksums = _random_headers(rng, with_checksums=trial % 2 == 1)
        fast, slow = _segment(), _segment()
        write_headers(header_table(fast, STRIDE), slots, generation, reqs, lens, checksums)
        for i, slot in enumerate(slots):
            header = SlotHeader(generation, reqs[i], lens[i], checksums[i] if checksums else None)
            write_header(slow[slot * STRIDE:], header)
        assert bytes(fast) == bytes(slow)


def test_check_slots_agrees_with_check_slot() -> None:
    rng = random.Random(1)
    buf = _segment()
    table = header_table(buf, STRIDE)
    for slot in range(SLOTS):  # a mix of good, stale, foreign, short, torn and checksummed slots
        kind = slot % 6
        if kind == 5:
            continue  # never written: torn
        generation = 3 if kind != 1 else 2
        req = 100 + slot if kind != 2 else 999
        length = PAYLOAD if kind != 3 else PAYLOAD - 1
        checksum = None
        if kind == 4:
            buf[slot * STRIDE + HEADER_BYTES:slot * STRIDE + HEADER_BYTES + PAYLOAD] = rng.randbytes(PAYLOAD)
            checksum = payload_checksum(buf[slot * STRIDE + HEADER_BYTES:][:PAYLOAD])
        write_claim(buf[slot * STRIDE:], WRITER, 100 + slot)  # the fill asked for, claimed
        write_header(buf[slot * STRIDE:], SlotHeader(generation, req, length, checksum, WRITER))
    slots = list(range(SLOTS))
    reqs = [100 + s for s in slots]
    fast = check_slots(table, slots, 3, reqs, PAYLOAD)
    for slot, ok in zip(slots, fast.tolist(), strict=True):
        reference = check_slot(buf[slot * STRIDE:][:STRIDE], 3, 100 + slot, PAYLOAD) is None
        if ok:  # the quick check accepts only what the reference accepts
            assert reference
        if slot % 6 == 0:
            assert ok
        if slot % 6 == 4:  # checksummed: only the slow path verifies it
            assert reference and not ok


def _mixed_headers(buf: memoryview) -> None:
    """Headers of every kind check_slots tells apart, at random: good, stale, foreign,
    short, torn, checksummed, unknown flag bits, wrong magic or version, committed by
    a writer that does not hold the claim, unclaimed, or for another fill."""
    rng = random.Random(2)
    for slot in range(SLOTS):
        kind = rng.randrange(12)
        write_claim(buf[slot * STRIDE:], WRITER if kind != 10 else 0, 100 + slot if kind != 11 else 8)
        write_header(buf[slot * STRIDE:], SlotHeader(3 if kind != 1 else 2, 100 + slot if kind != 2 else 7,
                                                     PAYLOAD if kind != 3 else 1, 5 if kind == 5 else None,
                                                     WRITER if kind != 9 else WRITER + 1))
        if kind == 4:
            clear_header(buf[slot * STRIDE:])
        elif kind == 6:
            buf[slot * STRIDE + 6] |= 0x02  # a flag bit this version does not know
        elif kind == 7:
            buf[slot * STRIDE] = ord("X")
        elif kind == 8:
            buf[slot * STRIDE + 4] = 9


def test_header_table_checks_few_slots_as_check_slots_does() -> None:
    buf = _segment()
    _mixed_headers(buf)
    table = HeaderTable(buf, STRIDE)
    rng = random.Random(3)
    for _ in range(200):
        slots = rng.sample(range(SLOTS), rng.randint(1, SLOTS))
        reqs = [100 + s if rng.random() < 0.9 else 7 for s in slots]
        generation = rng.choice([3, 3, 3, 2])
        expected = check_slots(table.records, slots, generation, reqs, PAYLOAD).tolist()
        assert table.check(slots, generation, reqs, PAYLOAD) == expected
    assert any(table.check(list(range(FEW_SLOTS)), 3, [100 + s for s in range(FEW_SLOTS)], PAYLOAD))


def test_header_table_writes_and_clears_few_slots_as_the_table_functions_do() -> None:
    rng = random.Random(4)
    for trial in range(100):
        slots, generation, reqs, lens, checksums = _random_headers(rng, with_checksums=trial % 2 == 1)
        written_lens: int | list[int] = lens[0] if trial % 3 == 0 else lens  # one length for all, or each its own
        garbage = bytearray(rng.randbytes(SLOTS * STRIDE))  # payloads; headers cleared, as students leave them
        for slot in range(SLOTS):
            garbage[slot * STRIDE:slot * STRIDE + HEADER_BYTES] = bytes(HEADER_BYTES)
        ours, reference = memoryview(bytearray(garbage)), memoryview(bytearray(garbage))
        HeaderTable(ours, STRIDE).write(slots, generation, reqs, written_lens, checksums)
        write_headers(header_table(reference, STRIDE), slots, generation, reqs, written_lens, checksums)
        assert bytes(ours) == bytes(reference)
        cleared = slots[:rng.randint(1, len(slots))]
        HeaderTable(ours, STRIDE).clear(cleared)
        clear_headers(header_table(reference, STRIDE), cleared)
        assert bytes(ours) == bytes(reference)
        table = HeaderTable(ours, STRIDE)
        assert [table.request_id(s) for s in slots] == [0 if s in cleared else r for s, r in zip(slots, reqs, strict=True)]


def test_header_table_refuses_slots_outside_it_and_zeroes_reserved_bytes() -> None:
    """NumPy would wrap a negative index to the last slot; the table refuses it instead.
    A commit is whole: reserved bytes a bad writer left behind are zeroed; the claim and
    the fill (not a commit's to write) stay as they were."""
    buf = _segment()
    table = HeaderTable(buf, STRIDE)
    buf[STRIDE:2 * STRIDE] = b"\xff" * STRIDE
    table.write([1], 2, [3], PAYLOAD, writer=WRITER)
    assert bytes(buf[STRIDE + 36:STRIDE + 40]) == bytes(4)
    assert read_header(buf[STRIDE:]) == SlotHeader(2, 3, PAYLOAD, None, WRITER)
    assert read_claim(buf[STRIDE:]) == (2**64 - 1, 2**64 - 1)
    assert bytes(buf[STRIDE + HEADER_BYTES:2 * STRIDE]) == b"\xff" * (STRIDE - HEADER_BYTES)
    buf[STRIDE:2 * STRIDE] = bytes(STRIDE)
    for slot in (-1, SLOTS):
        with pytest.raises(IndexError, match="outside"):
            table.write([slot], 1, [1], PAYLOAD)
        with pytest.raises(IndexError, match="outside"):
            table.clear([slot])
        with pytest.raises(IndexError, match="outside"):
            table.check([slot], 1, [1], PAYLOAD)
    assert bytes(buf) == bytes(len(buf)) and len(table) == SLOTS


def test_clear_headers_invalidates_only_those_slots() -> None:
    buf = _segment()
    table = header_table(buf, STRIDE)
    write_headers(table, list(range(SLOTS)), 1, list(range(SLOTS)), PAYLOAD)
    clear_headers(table, [2, 5])
    reference = _segment()
    write_headers(header_table(reference, STRIDE), list(range(SLOTS)), 1, list(range(SLOTS)), PAYLOAD)
    clear_header(reference[2 * STRIDE:])
    clear_header(reference[5 * STRIDE:])
    assert bytes(buf) == bytes(reference)
    assert read_header(buf[2 * STRIDE:]) is None and read_header(buf[3 * STRIDE:]) is not None


def test_gather_matches_per_sample_copies() -> None:
    config = BatchConfig([TensorSpec("a", (3, 2), "bfloat16"), TensorSpec("b", (5,), "int64"),
                          TensorSpec("c", (1,), "bool")])
    stride = slot_stride(config.nbytes())
    buf = bytearray(8 * stride)
    rows = torch.frombuffer(buf, dtype=torch.uint8).view(8, stride)[:, HEADER_BYTES:HEADER_BYTES + config.nbytes()]
    gen = torch.Generator().manual_seed(0)
    samples = []
    for slot in range(8):
        sample = {"a": torch.randn(3, 2, generator=gen).bfloat16(),
                  "b": torch.randint(-9, 9, (5,), generator=gen), "c": torch.rand(1, generator=gen) > 0.5}
        config.write(memoryview(buf)[slot * stride + HEADER_BYTES:][:config.nbytes()], **sample)
        samples.append(sample)
    picks = [6, 1, 3]
    out = {s.name: torch.zeros((5, *s.shape), dtype=s.torch_dtype) for s in config.specs}
    config.gather(rows, torch.tensor(picks), out, start=2)
    for i, slot in enumerate(picks):
        for name in ("a", "b", "c"):
            assert torch.equal(out[name][2 + i], samples[slot][name])
    assert not out["b"][:2].any()
    assert np.all(np.asarray(out["b"][:2]) == 0)


def test_gather_of_large_rows_uses_exact_bounds() -> None:
    """Rows of >= LARGE_ROW_BYTES take the memmove path: same bytes as index_select, the
    rows around the copied ones untouched, and an index outside the slots refused."""
    width = LARGE_ROW_BYTES + 192  # not a multiple of anything convenient
    stride = slot_stride(width)
    buf = torch.randint(0, 256, (6 * stride,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    rows = buf.view(6, stride)[:, HEADER_BYTES:HEADER_BYTES + width]
    out = torch.full((5, width), 7, dtype=torch.uint8)
    copy_rows(rows, torch.tensor([4, 0, 5]), out[1:4])
    assert torch.equal(out[1:4], torch.index_select(rows, 0, torch.tensor([4, 0, 5])))
    assert bool((out[0] == 7).all()) and bool((out[4] == 7).all())
    with pytest.raises(IndexError, match="outside"):
        copy_rows(rows, torch.tensor([6]), out[:1])
    with pytest.raises(IndexError, match="outside"):
        copy_rows(rows, torch.tensor([-1]), out[:1])


def test_gather_copies_large_tensors_by_address_and_small_ones_by_index() -> None:
    """A sample with a large tensor between small ones: the large one goes by memmove
    (offset inside the row), the others by index_select; rows around the batch rows
    are untouched, and a gather that would not fit the batch writes nothing."""
    config = BatchConfig([TensorSpec("ids", (3,), "int64"),
                          TensorSpec("hidden", (LARGE_ROW_BYTES // 2 + 8,), "bfloat16"),
                          TensorSpec("mask", (5,), "uint8")])
    stride = slot_stride(config.nbytes())
    buf = torch.randint(0, 256, (5 * stride,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    rows = buf.view(5, stride)[:, HEADER_BYTES:HEADER_BYTES + config.nbytes()]
    out = {s.name: torch.zeros((6, *s.shape), dtype=s.torch_dtype) for s in config.specs}
    config.gather(rows, [4, 0, 4], out, start=2)
    for i, slot in enumerate([4, 0, 4]):
        views = config.decode(memoryview(rows[slot].numpy()))
        for name, view in views.items():
            assert torch.equal(out[name][2 + i].view(torch.uint8), view.view(torch.uint8))  # NaNs too
    for name in ("ids", "hidden", "mask"):
        assert not out[name][:2].any() and not out[name][5:].any()
    before = {name: tensor.clone() for name, tensor in out.items()}
    with pytest.raises(ValueError, match="outside"):
        config.gather(rows, [1, 2], out, start=5)
    with pytest.raises(IndexError, match="outside"):
        config.gather(rows, [5], out, start=0)
    with pytest.raises(ValueError, match="rows of"):
        config.gather(rows, [1], {**out, "hidden": torch.zeros((6, 7), dtype=torch.bfloat16)})
    assert all(torch.equal(out[name].view(torch.uint8), before[name].view(torch.uint8)) for name in out)


def test_gather_falls_back_to_index_select_for_strided_targets() -> None:
    """A target that is not one contiguous block is never written through raw pointers."""
    rows = torch.arange(3 * LARGE_ROW_BYTES, dtype=torch.int32).to(torch.uint8).view(3, LARGE_ROW_BYTES)
    out = torch.zeros((LARGE_ROW_BYTES, 2), dtype=torch.uint8).t()  # [2, width], column-major
    copy_rows(rows, torch.tensor([2, 1]), out)
    assert torch.equal(out, rows[[2, 1]])
