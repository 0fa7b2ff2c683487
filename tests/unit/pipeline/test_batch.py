"""BatchConfig / TensorSpec: the seed README's API and a round trip for every dtype."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from distill.pipeline import DTYPES, BatchConfig, TensorSpec
from distill.pipeline.batch import LARGE_ROW_BYTES


def test_readme_nbytes() -> None:
    config = BatchConfig([
        TensorSpec("hidden", (512, 768), "bfloat16"),
        TensorSpec("labels", (512,), "int64"),
    ])
    assert config.nbytes() == 790528
    assert config.tensor_names == ["hidden", "labels"]
    assert config.get_spec("hidden").torch_dtype == torch.bfloat16
    assert config.get_spec("labels").nbytes == 4096


def test_all_ten_dtypes_round_trip() -> None:
    assert len(DTYPES) == 10
    specs = [TensorSpec(name, (3, 5), name) for name in DTYPES]
    config = BatchConfig(specs)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for spec in specs:
        if spec.torch_dtype.is_floating_point:
            tensors[spec.name] = torch.randn(3, 5, generator=gen).to(spec.torch_dtype)
        elif spec.torch_dtype == torch.bool:
            tensors[spec.name] = torch.rand(3, 5, generator=gen) > 0.5
        else:
            tensors[spec.name] = torch.randint(0, 100, (3, 5), generator=gen).to(spec.torch_dtype)
    data = config.encode(**tensors)
    assert len(data) == config.nbytes()
    decoded = config.decode(data)
    for name, tensor in tensors.items():
        assert decoded[name].dtype == tensor.dtype
        assert torch.equal(decoded[name], tensor)
        assert torch.equal(config.decode_single(data, name), tensor)


def test_decode_is_a_view_of_writable_buffers() -> None:
    config = BatchConfig([TensorSpec("x", (4,), "float32")])
    buf = bytearray(config.nbytes())
    view = config.decode(memoryview(buf))["x"]
    view.fill_(2.5)
    assert config.decode(bytes(buf))["x"].tolist() == [2.5] * 4


def test_write_checks_names_and_shapes() -> None:
    config = BatchConfig([TensorSpec("x", (4,), "float32")])
    buf = bytearray(config.nbytes())
    with pytest.raises(ValueError, match="missing"):
        config.write(buf, y=torch.zeros(4))
    with pytest.raises(ValueError, match="shape"):
        config.write(buf, x=torch.zeros(5))


def test_copy_into_writes_the_views_once_and_names_what_is_wrong() -> None:
    config = BatchConfig([TensorSpec("h", (2, 3), "bfloat16"), TensorSpec("n", (3,), "int64")])
    buf = bytearray(config.nbytes())
    views = config.decode(buf)
    h = torch.randn(2, 3, requires_grad=True).bfloat16()
    config.copy_into(views, {"h": h, "n": torch.tensor([1, 2, 3])})
    assert bytes(buf) == config.encode(h=h, n=torch.tensor([1, 2, 3]))  # what encode makes, byte for byte
    assert not views["h"].requires_grad  # no autograd history left on the slot's views
    before = bytes(buf)
    for bad, why in [({"h": h}, r"missing \['n'\]"),
                     ({"h": h, "n": torch.zeros(3, dtype=torch.int64), "m": h}, r"unexpected \['m'\]"),
                     ({"h": h.float(), "n": torch.zeros(3, dtype=torch.int64)}, "'h': dtype torch.float32 != spec"),
                     ({"h": h, "n": torch.zeros(4, dtype=torch.int64)}, r"'n': shape \(4,\) != spec \(3,\)"),
                     ({"h": h, "n": [0, 0, 0]}, "'n': got list, not a torch.Tensor")]:
        with pytest.raises(ValueError, match=why):
            config.copy_into(views, bad)
    assert bytes(buf) == before  # checked before anything is written
    large = BatchConfig([TensorSpec("big", (LARGE_ROW_BYTES // 4 + 1,), "float32"), TensorSpec("n", (3,), "int64")])
    buf = bytearray(large.nbytes())
    big = torch.randn(LARGE_ROW_BYTES // 4 + 1)
    large.copy_into(large.decode(buf), {"big": big, "n": torch.tensor([4, 5, 6])})  # memmove, then copy_
    assert bytes(buf) == large.encode(big=big, n=torch.tensor([4, 5, 6]))


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="dtype"):
        TensorSpec("x", (1,), "complex64")
    with pytest.raises(ValueError, match="duplicate"):
        BatchConfig([TensorSpec("x", (1,), "int8"), TensorSpec("x", (2,), "int8")])
    with pytest.raises(ValueError, match="shorter"):
        BatchConfig([TensorSpec("x", (8,), "int8")]).decode(b"1234")


def test_from_dict_and_yaml(tmp_path) -> None:
    spec = {"specs": [{"name": "x", "shape": [512, 768], "dtype": "bfloat16"},
                      {"name": "y", "shape": [512, 768], "dtype": "bfloat16"}]}
    config = BatchConfig.from_dict(spec)
    path = tmp_path / "config.yaml"
    path.write_text(OmegaConf.to_yaml(spec))
    assert BatchConfig.from_yaml(path) == config
    assert config.nbytes() == 2 * 512 * 768 * 2


def test_hydra_instantiate() -> None:
    cfg = OmegaConf.create({"batch_config": {
        "_target_": "distill.pipeline.BatchConfig",
        "specs": [{"name": "x", "shape": [512, 768], "dtype": "bfloat16"}],
    }})
    config = instantiate(cfg.batch_config)
    assert isinstance(config, BatchConfig)
    assert config.get_spec("x").shape == (512, 768)


def test_encode_makes_bytes_with_the_values_converted_and_checks_names_and_shapes() -> None:
    config = BatchConfig([TensorSpec("h", (2, 3), "bfloat16"), TensorSpec("n", (4,), "int64"),
                          TensorSpec("b", (2,), "bool"), TensorSpec("e", (0,), "float32")])
    h, n, b = torch.randn(2, 3), torch.arange(4, dtype=torch.int32), torch.tensor([True, False])
    data = config.encode(h=h, n=n, b=b, e=torch.empty(0))
    written = bytearray(config.nbytes())
    config.write(written, h=h, n=n, b=b, e=torch.empty(0))  # what write() makes, byte for byte
    assert isinstance(data, bytes) and data == bytes(written)
    with pytest.raises(ValueError, match="missing \\['e'\\]"):
        config.encode(h=h, n=n, b=b)
    with pytest.raises(ValueError, match="shape"):
        config.encode(h=h.T, n=n, b=b, e=torch.empty(0))


def test_take_copies_rows_into_fresh_batch_tensors_like_gather() -> None:
    config = BatchConfig([TensorSpec("h", (2, 3), "bfloat16"), TensorSpec("n", (4,), "int64"),
                          TensorSpec("e", (0,), "float32")])
    rows = torch.zeros(5, config.nbytes() + 16, dtype=torch.uint8)  # wider rows, as slots are
    for i in range(5):
        encoded = config.encode(h=torch.full((2, 3), float(i)), n=torch.arange(4) + i, e=torch.empty(0))
        rows[i, :config.nbytes()] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    taken = config.take(rows, [3, 1])
    gathered = {s.name: torch.empty((2, *s.shape), dtype=s.torch_dtype) for s in config.specs}
    config.gather(rows, [3, 1], gathered)
    assert list(taken) == ["h", "n", "e"] and taken["e"].shape == (2, 0)
    assert all(torch.equal(taken[name], gathered[name]) for name in gathered)
    assert taken["n"][0].tolist() == [3, 4, 5, 6]
    with pytest.raises(IndexError):
        config.take(rows, [5])
