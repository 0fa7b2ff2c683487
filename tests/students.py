"""Helpers the exported-student tests share: one thread, and replacements moved off their init.

Shape legend: none.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def single_thread() -> Iterator[None]:
    """Tiny models gain nothing from threads, and one thread gives the same reduction order in
    every run compared (import it into a test module to have it there)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def nudged(replacements: dict[int, torch.nn.Module], scale: float = 0.05) -> dict[int, torch.nn.Module]:
    """Every replacement parameter moved by ``scale`` noise off its teacher-derived start (so a
    re-init, or a kind that copies the teacher, would show); returns ``replacements``."""
    with torch.no_grad():
        for module in replacements.values():
            for param in module.parameters():
                param.add_(torch.randn_like(param) * scale)
    return replacements
