"""GPU placement of mode=local: teacher workers and student ranks never share a GPU unless
``device.share_gpu=true``; every refusal names the keys to change."""

from __future__ import annotations

import pytest

from distill.config import typed_config
from distill.modes.placement import GpuPlacement, plan_local
from tests.unit.test_config import _compose


def _plan(overrides: list[str], gpus: int) -> GpuPlacement:
    return plan_local(typed_config(_compose(["mode=local", *overrides])), gpus)


def test_students_go_where_no_teacher_is() -> None:
    assert _plan(["device=gpu"], 2) == GpuPlacement((0,), (1,))
    assert _plan(["device=gpu", "device.worker_gpus=[0,1]", "local.num_students=2"], 4) == GpuPlacement((0, 1), (2, 3))
    assert _plan(["device=gpu", "device.worker_gpu=1", "local.num_students=2"], 3) == GpuPlacement((1,), (0, 2))
    assert _plan([], 0) == GpuPlacement((), ())  # everything on CPU
    assert _plan(["device=gpu", "device.worker_gpu=null"], 1) == GpuPlacement((), (0,))


def test_one_gpu_is_shared_only_when_asked() -> None:
    with pytest.raises(ValueError, match="device.share_gpu=true"):
        _plan(["device=gpu"], 1)
    assert _plan(["device=gpu", "device.share_gpu=true"], 1) == GpuPlacement((0,), (0,))
    with pytest.raises(ValueError, match=r"student ranks on GPU\(s\) \[0\]"):
        _plan(["device=gpu", "device.student_gpus=[0]"], 2)
    assert _plan(["device=gpu", "device.student_gpus=[0]", "device.share_gpu=true"], 2) == GpuPlacement((0,), (0,))


def test_gpus_that_do_not_exist_are_refused() -> None:
    with pytest.raises(ValueError, match="device.student_gpus=\\[1\\] names 1 GPU"):
        _plan(["device=gpu", "device.student_gpus=[1]", "local.num_students=2"], 4)
    with pytest.raises(ValueError, match="device.worker_gpus names GPU"):
        _plan(["device=gpu", "device.worker_gpus=[2,3]"], 2)
