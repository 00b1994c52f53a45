"""Writing a converted checkpoint: a streaming safetensors writer, and reading a checkpoint's tensor shapes back.

ShardedWriter   tensors go to disk as they are produced, shard by shard, named and indexed like `save_pretrained`
read_shapes     tensor name -> shape, from the safetensors headers only

The writers put it into `checkpoints.atomic.atomic_folder`'s temporary folder, which replaces the output only when
complete.
"""

import json
import math
from pathlib import Path

import torch
from transformers.utils.hub import convert_file_size_to_int

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"


# safetensors' names of the dtypes a converted checkpoint holds.
_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class ShardedWriter:
    """Writes a planned set of tensors into safetensors shards as they arrive, in any order.

    The converter knows every output tensor's name and shape before it starts (from the model built on the meta
    device), so the shards and their headers are laid out up front and each tensor is written at its final offset as
    soon as it is produced: memory stays at the tensors the caller holds (one layer), not one shard. Files and the
    index are named like `save_pretrained` (one shard: `model.safetensors` without an index).
    """

    def __init__(
        self,
        folder: Path,
        shapes: dict[str, tuple[int, ...]],
        dtype: torch.dtype,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    ):
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"Cannot write {dtype} weights; choose one of {', '.join(map(str, _SAFETENSORS_DTYPES))}.")
        self.folder = Path(folder)
        self.dtype = dtype
        self.planned = dict(shapes)
        self.shapes: dict[str, tuple[int, ...]] = {}  # every tensor written so far
        item = torch.empty((), dtype=dtype).element_size()
        limit = convert_file_size_to_int(max_shard_size)

        # Cut the planned tensors, in order, into shards of at most `limit` bytes (a bigger tensor gets its own).
        shards: list[dict[str, tuple[int, int]]] = [{}]
        used = 0
        for name, shape in self.planned.items():
            size = math.prod(shape) * item
            if shards[-1] and used + size > limit:
                shards.append({})
                used = 0
            shards[-1][name] = (used, used + size)
            used += size
        self.total_bytes = sum(end - start for shard in shards for start, end in shard.values())

        names = (
            [SAFE_WEIGHTS]
            if len(shards) == 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        self.files = dict(zip(names, shards))
        self._where: dict[str, tuple[Path, int]] = {}  # tensor name -> (file, absolute offset of its bytes)
        for file, shard in self.files.items():
            header = {"__metadata__": {"format": "pt"}}
            header.update(
                {
                    name: {
                        "dtype": _SAFETENSORS_DTYPES[dtype],
                        "shape": list(self.planned[name]),
                        "data_offsets": [a, b],
                    }
                    for name, (a, b) in shard.items()
                }
            )
            encoded = json.dumps(header, separators=(",", ":")).encode()
            encoded += b" " * (-len(encoded) % 8)  # safetensors aligns the data to 8 bytes
            path = self.folder / file
            with open(path, "wb") as handle:
                handle.write(len(encoded).to_bytes(8, "little") + encoded)
                handle.truncate(8 + len(encoded) + max((b for _, b in shard.values()), default=0))
            for name, (a, _) in shard.items():
                self._where[name] = (path, 8 + len(encoded) + a)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.shapes:
            raise ValueError(f"Tensor {name} was written twice.")
        if name not in self._where or tuple(tensor.shape) != self.planned[name]:
            raise ValueError(f"Tensor {name} {tuple(tensor.shape)} is not part of the planned checkpoint.")
        if not tensor.is_floating_point():
            raise ValueError(f"Tensor {name} is not floating point ({tensor.dtype}); cannot store it as {self.dtype}.")
        data = tensor.detach().to(device="cpu", dtype=self.dtype).contiguous().view(torch.uint8).numpy()
        path, offset = self._where[name]
        with open(path, "r+b") as handle:
            handle.seek(offset)
            handle.write(memoryview(data))
        self.shapes[name] = tuple(tensor.shape)

    def close(self, total_parameters: int | None = None) -> list[str]:
        """Check that every planned tensor was written and write the index. Returns the file names."""
        missing = [name for name in self.planned if name not in self.shapes]
        if missing:
            raise ValueError(f"Conversion did not produce {len(missing)} tensors, e.g. {missing[:3]}.")
        if len(self.files) == 1:
            return list(self.files)
        metadata = {"total_size": self.total_bytes}
        if total_parameters is not None:
            metadata["total_parameters"] = total_parameters
        weight_map = {name: file for file, shard in self.files.items() for name in shard}
        index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return [*self.files, SAFE_INDEX]


def check_weights(folder) -> None:
    """A folder's safetensors weights are all there and readable: one line for a missing or truncated shard, not a
    traceback from the loader (a no-op where there are none, e.g. a Hub id)."""
    folder = Path(folder)
    if (folder / SAFE_WEIGHTS).is_file() or (folder / SAFE_INDEX).is_file():
        read_shapes(folder)


def read_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of a saved safetensors checkpoint, from the file headers only (no tensor is loaded); a
    missing, corrupt or truncated weight file is refused in one line."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    if (folder / SAFE_INDEX).is_file():
        files = sorted(set(json.loads((folder / SAFE_INDEX).read_text())["weight_map"].values()))
    elif (folder / SAFE_WEIGHTS).is_file():
        files = [SAFE_WEIGHTS]
    else:
        raise FileNotFoundError(f"{folder} has no safetensors weights ({SAFE_WEIGHTS} or {SAFE_INDEX}).")
    shapes = {}
    for file in files:
        if not (folder / file).is_file():
            raise FileNotFoundError(f"{folder / file} is missing: {SAFE_INDEX} names it (an incomplete download?).")
        try:
            with safe_open(folder / file, framework="pt") as handle:
                for name in handle.keys():
                    shapes[name] = tuple(handle.get_slice(name).get_shape())
        except SafetensorError as error:
            raise ValueError(f"Cannot read {folder / file}: it is corrupt or truncated ({error}).") from None
    return shapes
