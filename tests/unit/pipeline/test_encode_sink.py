"""``BatchConfig.encode`` while a worker's generator fills a slot (``encode_sink.py``):
large samples land in the open slot with the bytes a plain ``encode`` makes, the result
is a read-only view that ends with the call, and everything else still gets bytes."""

from __future__ import annotations

import pytest
import torch

from distill.pipeline import BatchConfig, TensorSpec, encode_sink

FLOATS = 20_000  # 80,000 bytes of x: over ENCODE_INTO_MIN_BYTES
CONFIG = BatchConfig([TensorSpec("x", (FLOATS,), "float32"), TensorSpec("tag", (3,), "int16"),
                      TensorSpec("w", (4, 5), "bfloat16")])


def _sources() -> dict[str, torch.Tensor]:
    """Tensors encode must convert: float64 for float32, a non-contiguous int64 for int16,
    one that requires grad."""
    return {"x": torch.linspace(-3, 3, FLOATS, dtype=torch.float64),
            "tag": torch.tensor([[1, 9], [2, 9], [3, 9]])[:, 0],
            "w": torch.randn(4, 5, requires_grad=True)}


def test_outside_a_worker_encode_makes_bytes() -> None:
    assert CONFIG.nbytes() >= encode_sink.ENCODE_INTO_MIN_BYTES
    assert type(CONFIG.encode(**_sources())) is bytes


def test_a_large_encode_lands_in_the_open_slot_with_the_same_bytes() -> None:
    tensors = _sources()
    expected = CONFIG.encode(**tensors)
    slot = bytearray(CONFIG.nbytes() + 100)
    encode_sink.open_slot(memoryview(slot))
    data = None
    try:
        data = CONFIG.encode(**tensors)
        second = CONFIG.encode(**tensors)  # only the first of a call takes the slot
        assert isinstance(data, memoryview) and data.readonly
        assert data == expected and bytes(data) == expected and len(data) == CONFIG.nbytes()
    finally:
        in_slot = encode_sink.close_slot(data)
    assert in_slot == CONFIG.nbytes()  # returned as handed out: already in the slot
    assert type(second) is bytes and second == expected
    assert bytes(slot[:CONFIG.nbytes()]) == expected and not any(slot[CONFIG.nbytes():])
    with pytest.raises(ValueError, match="released"):
        len(data)  # kept past its call: fails loudly, never reads a reused slot


def test_small_samples_bad_tensors_and_short_slots_keep_the_plain_path() -> None:
    small = BatchConfig([TensorSpec("x", (16,), "float32")])
    encode_sink.open_slot(memoryview(bytearray(1 << 20)))
    try:
        assert type(small.encode(x=torch.zeros(16))) is bytes
        with pytest.raises(ValueError, match="shape"):
            CONFIG.encode(**{**_sources(), "x": torch.zeros(3)})  # refused before it takes the slot
        assert isinstance(CONFIG.encode(**_sources()), memoryview)
    finally:
        encode_sink.close_slot(None)
    encode_sink.open_slot(memoryview(bytearray(CONFIG.nbytes() - 1)))
    try:
        assert type(CONFIG.encode(**_sources())) is bytes  # does not fit: the worker reports it
    finally:
        assert encode_sink.close_slot(None) == 0
