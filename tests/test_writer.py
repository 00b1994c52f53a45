"""The streaming safetensors writer: shards laid out up front, tensors written in any order at their offsets."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from llama_moe_hf.checkpoints.writer import SAFE_INDEX, SAFE_WEIGHTS, ShardedWriter, read_shapes


def test_tensors_written_in_any_order_load_back_exactly(tmp_path):
    shapes = {"a.weight": (3, 4), "b.weight": (5,), "c.weight": (7, 2), "d.weight": (2, 2)}
    tensors = {name: torch.randn(shape) for name, shape in shapes.items()}
    writer = ShardedWriter(tmp_path, shapes, torch.bfloat16, max_shard_size=40)  # 40 bytes: several shards
    for name in ["c.weight", "a.weight", "d.weight", "b.weight"]:
        writer.add(name, tensors[name])
    files = writer.close(total_parameters=sum(t.numel() for t in tensors.values()))

    assert SAFE_INDEX in files and len(files) > 2
    index = json.loads((tmp_path / SAFE_INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())
    loaded = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(tmp_path / file, framework="pt") as handle:  # the real reader validates header and sizes
            assert handle.metadata() == {"format": "pt"}
        loaded.update(load_file(tmp_path / file))
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor.to(torch.bfloat16))
    assert read_shapes(tmp_path) == shapes


def test_single_shard_is_model_safetensors_without_index(tmp_path):
    writer = ShardedWriter(tmp_path, {"w": (4, 4)}, torch.float32)
    writer.add("w", torch.ones(4, 4))
    assert writer.close() == [SAFE_WEIGHTS]
    assert torch.equal(load_file(tmp_path / SAFE_WEIGHTS)["w"], torch.ones(4, 4))


def test_unplanned_duplicate_and_missing_tensors_are_refused(tmp_path):
    writer = ShardedWriter(tmp_path, {"w": (2,), "v": (3,)}, torch.float32)
    with pytest.raises(ValueError, match="not part of the planned checkpoint"):
        writer.add("x", torch.zeros(2))
    with pytest.raises(ValueError, match="not part of the planned checkpoint"):
        writer.add("w", torch.zeros(3))
    writer.add("w", torch.zeros(2))
    with pytest.raises(ValueError, match="written twice"):
        writer.add("w", torch.zeros(2))
    with pytest.raises(ValueError, match="did not produce 1 tensors"):
        writer.close()
