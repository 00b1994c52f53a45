"""The streaming safetensors writer (shards laid out up front, tensors written in any order at their offsets) and
atomic writing (`checkpoints.atomic`)."""

import json
import os
import stat

import pytest
import torch
from helpers import interrupt_the_second_replace
from safetensors import safe_open
from safetensors.torch import load_file

from llama_moe.checkpoints.atomic import atomic_file, atomic_folder, remove_folder, replace_files
from llama_moe.checkpoints.writer import SAFE_INDEX, SAFE_WEIGHTS, ShardedWriter, read_shapes


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


# Atomic writing (`checkpoints.atomic`): every writer's output is whole or as it was, with the umask's permissions.


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_an_atomic_folder_replaces_the_output_only_when_complete(tmp_path, umask_022):
    output = tmp_path / "new" / "out"
    with pytest.raises(KeyboardInterrupt), atomic_folder(output) as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise KeyboardInterrupt
    assert not (tmp_path / "new").exists()  # no output, no temporary folder, no parent it created
    with atomic_folder(output) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "sub" / "weights.bin").write_bytes(b"1")
        (tmp / "weights.bin").write_bytes(b"1")
        (tmp / "weights.bin").chmod(0o600)  # as transformers writes safetensors files
    modes = {p.relative_to(output).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in [output, *output.rglob("*")]}
    assert modes == {".": 0o755, "sub": 0o755, "sub/weights.bin": 0o644, "weights.bin": 0o644}
    with pytest.raises(ValueError), atomic_folder(output) as tmp:  # --overwrite that fails: the old one stays
        (tmp / "other.bin").write_bytes(b"2")
        raise ValueError
    with atomic_folder(output) as tmp:
        (tmp / "other.bin").write_bytes(b"2")
    assert sorted(p.name for p in output.iterdir()) == ["other.bin"]
    assert sorted(p.name for p in output.parent.iterdir()) == ["out"]


def test_an_atomic_folder_from_a_staging_folder_or_keeping_what_appeared(tmp_path, umask_022):
    staging, output = tmp_path / ".out.staging", tmp_path / "out"
    staging.mkdir()
    (staging / "a.bin").write_bytes(b"a")  # written by several processes under a name they all know
    with atomic_folder(output, staging=staging) as tmp:
        assert tmp == staging
        (tmp / "b.bin").write_bytes(b"b")
    assert sorted(p.name for p in output.iterdir()) == ["a.bin", "b.bin"] and not staging.exists()
    with pytest.raises(OSError), atomic_folder(output, replace=False) as tmp:  # another process was first
        (tmp / "c.bin").write_bytes(b"c")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in output.iterdir()) == ["a.bin", "b.bin"]


def test_an_atomic_file_and_a_removed_folder_are_whole_or_absent(tmp_path, umask_022):
    path = tmp_path / "results.json"
    with pytest.raises(KeyboardInterrupt), atomic_file(path) as tmp:
        tmp.write_text("half")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []
    with atomic_file(path) as tmp:
        tmp.write_text("{}")
    assert path.read_text() == "{}" and stat.S_IMODE(path.stat().st_mode) == 0o644
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "file").write_text("x")
    remove_folder(tmp_path / "folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]


def test_replace_files_is_all_or_nothing_and_leaves_the_other_files_alone(tmp_path, monkeypatch, umask_022):
    (tmp_path / "config.json").write_text("old config")
    (tmp_path / "config.json").chmod(0o640)
    (tmp_path / "weights.bin").write_bytes(b"weights")
    inode = (tmp_path / "weights.bin").stat().st_ino
    files = {"config.json": b"new config", "code.py": b"new code"}
    interrupt_the_second_replace(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        replace_files(tmp_path, files)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "weights.bin"]  # no temporary file either
    assert (tmp_path / "config.json").read_text() == "old config"
    replace_files(tmp_path, files)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["code.py", "config.json", "weights.bin"]
    assert (tmp_path / "config.json").read_bytes() == b"new config" and (
        tmp_path / "code.py"
    ).read_bytes() == b"new code"
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes["config.json"] == 0o640 and modes["code.py"] == 0o644  # a replaced file keeps its permissions
    assert (tmp_path / "weights.bin").stat().st_ino == inode
