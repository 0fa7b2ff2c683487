"""SlotLoans: a lent sample is a view of its slot (no copy), and its slot comes back
exactly when the last tensor over it is gone, views made of it included, whichever
thread lets go; the limit leaves the rest of the pool to the workers."""

from __future__ import annotations

import gc
import threading

import torch

from distill.pipeline import BatchConfig, TensorSpec
from distill.pipeline.student.loans import SlotLoans

CONFIG = BatchConfig([TensorSpec("h", (2, 3), "bfloat16"), TensorSpec("n", (4,), "int64"),
                      TensorSpec("none", (0,), "float32")])


def _slots(count: int) -> tuple[bytearray, list[memoryview]]:
    data = bytearray(count * CONFIG.nbytes())
    whole = memoryview(data)
    return data, [whole[i * CONFIG.nbytes():(i + 1) * CONFIG.nbytes()] for i in range(count)]


def test_a_lent_sample_is_its_slot_and_comes_back_when_its_last_view_is_gone() -> None:
    _, views = _slots(2)
    h, n = torch.randn(2, 3).bfloat16(), torch.arange(4)
    views[1][:] = CONFIG.encode(h=h, n=n, none=torch.empty(0))
    loans = SlotLoans(CONFIG, limit=2)
    sample = loans.lend(1, views[1])
    assert torch.equal(sample["h"], h) and torch.equal(sample["n"], n) and sample["none"].shape == (0,)
    views[1][CONFIG.nbytes() - 8:] = bytes(8)  # no copy: the slot's bytes are the sample's
    assert int(sample["n"][3]) == 0
    row = sample["h"][0, 1:]  # a view made of a lent tensor keeps the loan
    del sample
    gc.collect()
    assert loans.returned() == [] and loans.out == 1 and loans.room() is not False
    del row
    assert loans.returned() == [1] and loans.out == 0
    assert loans.returned() == []  # each slot comes back once


def test_the_limit_says_when_to_copy_instead() -> None:
    _, views = _slots(3)
    loans = SlotLoans(CONFIG, limit=2)
    held = [loans.lend(i, views[i]) for i in range(2)]
    assert not loans.room()
    held.pop()
    assert loans.returned() == [1] and loans.room()


def test_a_loan_ended_in_another_thread_comes_back_here() -> None:
    _, views = _slots(1)
    loans = SlotLoans(CONFIG, limit=1)
    box = [loans.lend(0, views[0])]
    thread = threading.Thread(target=box.clear)  # e.g. a DataLoader's pin-memory thread
    thread.start()
    thread.join()
    assert loans.returned() == [0]


def test_tensors_packed_off_their_alignment_are_lent_exactly() -> None:
    """Packed back to back, a tensor may start off a multiple of its item size: it is lent
    through bytes then (an aligned one straight in its dtype), with the same values."""
    config = BatchConfig([TensorSpec("b", (3,), "int8"), TensorSpec("w", (2, 2), "int64"),
                          TensorSpec("f", (5,), "float32")])
    data = bytearray(2 * config.nbytes() + 8)
    sample = {"b": torch.tensor([1, -2, 3], dtype=torch.int8), "w": torch.tensor([[2**40, -5], [7, 9]]),
              "f": torch.linspace(0, 1, 5)}
    for start in (0, 1, 8):  # the slot itself at several alignments
        view = memoryview(data)[start:start + config.nbytes()]
        view[:] = config.encode(**sample)
        lent = SlotLoans(config, limit=1).lend(0, view)
        assert all(torch.equal(lent[name], tensor) for name, tensor in sample.items())
