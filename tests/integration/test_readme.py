"""The seed README's examples, with only the import changed (softs -> distill.pipeline)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from distill.pipeline import (
    BatchConfig,
    Broker,
    DistillIterableDataset,
    StudentClient,
    TensorSpec,
    Worker,
    setup_logging,
)
from distill.pipeline.mediums import MediumBase, SharedMemoryManager


@pytest.fixture
def private_runtime_dir(tmp_path, monkeypatch):
    """The README uses default endpoints: point them at a private temp directory."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def test_quick_start(private_runtime_dir) -> None:
    # 1. Define your data format with BatchConfig
    config = BatchConfig([
        TensorSpec("x", (3, 224, 224), "float32"),
        TensorSpec("y", (1000,), "float32"),
    ])

    # 2. Start the broker (the README runs it in its own terminal: here, a thread)
    setup_logging("INFO")
    broker = Broker()
    threading.Thread(target=broker.run, daemon=True).start()

    # 3. Start worker(s)
    def generate_sample(model_id: str, model_cfg: dict | None) -> bytes:
        x = torch.randn(3, 224, 224)
        y = torch.randn(1000)
        return config.encode(x=x, y=y)

    worker = Worker(generator_fn=generate_sample, slot_size=config.nbytes())
    threading.Thread(target=worker.run, daemon=True).start()

    # 4. Run student training
    client = StudentClient(student_rank=0, slot_count=16, batch_config=config)
    client.hello()
    client.set_model("my_model")
    dataset = DistillIterableDataset(
        student_rank=0,
        generation_value=client.generation_value,
        slot_count=8,
        batch_config=config,
    )
    seen = 0
    for batch in dataset:
        x, y = batch["x"], batch["y"]
        assert x.shape == (3, 224, 224) and y.shape == (1000,)
        seen += 1  # noqa: SIM113 (the README loop, as written)
        if seen == 20:
            break
    client.close()
    assert worker.generation == 1 and worker.model_id == "my_model"
    assert worker.samples_written >= 20
    deadline = time.monotonic() + 5  # fills the student asked for directly are counted at heartbeats
    while broker.stats.completed < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert broker.stats.completed >= 20
    worker.stop()
    broker.stop()


def test_client_api_and_context_manager(broker_kwargs, endpoints) -> None:
    config = BatchConfig([TensorSpec("hidden", (16, 8), "bfloat16"), TensorSpec("labels", (16,), "int64")])
    broker = Broker(**broker_kwargs).start()
    worker = Worker(generator_fn=lambda m, c: config.encode(hidden=torch.ones(16, 8), labels=torch.arange(16)),
                    slot_size=config.nbytes(), backend_endpoint=endpoints["backend"],
                    control_pub_endpoint=endpoints["control_pub"], worker_id=7).start()
    with StudentClient(0, 4, config, endpoints["frontend"], endpoints["control"],
                       endpoints["control_pub"]) as client:
        assert client.hello()["generation"] == 0
        assert client.set_model("layer_5", {"k": 1}) == 1
        assert client.generation == 1 and client.generation_value.value == 1
        ref = client.request_sample(timeout_ms=5000)
        assert ref is not None and ref.generation == 1
        assert torch.equal(ref.tensors["labels"], torch.arange(16))
        assert ref.tensors["hidden"].dtype == torch.bfloat16
        client.release_slot(ref.slot_id)
        with pytest.raises(ValueError, match="not held"):
            client.release_slot(ref.slot_id)
        assert client.set_model("layer_6") == 2
    worker.stop()
    broker.stop()


def test_custom_medium_from_the_readme(tmp_path) -> None:
    class FileMedium(MediumBase):
        """File-based medium (example for network filesystems)."""

        def __init__(self, slot_count: int, slot_stride: int, path: str):
            self._path = path
            self._slot_count = slot_count
            self._slot_stride = slot_stride
            self._file = open(path, "w+b")  # noqa: SIM115
            self._file.truncate(slot_count * slot_stride)

        @property
        def buf_name(self) -> str:
            return self._path

        @property
        def slot_count(self) -> int:
            return self._slot_count

        @property
        def slot_stride(self) -> int:
            return self._slot_stride

        def read_slot_tensors(self, slot_id: int) -> bytes:
            offset = slot_id * self._slot_stride
            self._file.seek(offset)
            return self._file.read(self._slot_stride)

        def close(self) -> None:
            self._file.close()

        def unlink(self) -> None:
            import os
            os.unlink(self._path)

    from distill.pipeline import Medium

    medium = FileMedium(4, 16, str(tmp_path / "slots.bin"))
    assert isinstance(medium, Medium)
    assert medium.read_slot_tensors(3) == bytes(16)
    medium.close()
    medium.unlink()


def test_shared_memory_manager_readme_form() -> None:
    shm = SharedMemoryManager(slot_count=16, slot_stride=1024, read_only=True)
    worker_side = SharedMemoryManager(slot_count=16, slot_stride=1024, read_only=False,
                                      run_id=shm.run_id, name=shm.buf_name)
    worker_side.slot_view(3)[:2] = b"ok"
    assert shm.read_slot_tensors(3)[:2] == b"ok"
    worker_side.close()
    shm.close()
