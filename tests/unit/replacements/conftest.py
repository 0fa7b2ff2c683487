"""Fixtures of the replacement tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    """Tiny tensors gain nothing from intra-op threads; on a busy shared CPU, OpenMP
    spin-waits make small matmuls and SVDs up to 100x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
