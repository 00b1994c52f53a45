"""Exporting a converted checkpoint: checks before anything is written, then one streaming pass in an atomic folder.

    open the folder -> the target refuses what it cannot express exactly -> plan every output tensor (the same
    code on meta tensors) -> stream: read a tensor, write its target tensors -> the temporary folder replaces the
    output

A refused or failed export leaves nothing behind (`atomic_folder`), and never touches its source.
"""

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path

from ..conversion.settings import DTYPES, check_dtype
from .base import checkpoint_roles, is_unused_at_inference, tensor_order
from .registry import TARGETS


@dataclasses.dataclass(frozen=True)
class ExportOptions:
    """Where and how to export (each a `llama-moe export` flag; the model folder is the positional argument)."""

    to: str = dataclasses.field(metadata={"help": "export target"})
    output: str = dataclasses.field(metadata={"help": "output folder (must not exist, unless --overwrite)"})
    overwrite: bool = dataclasses.field(default=False, metadata={"help": "replace an existing output folder"})
    dtype: str | None = dataclasses.field(
        default=None, metadata={"help": "weights dtype (default: the checkpoint's)", "choices": DTYPES}
    )
    progress: bool = dataclasses.field(default=True, metadata={"help": "show a progress bar"})
    eval: bool = dataclasses.field(
        default=True,
        metadata={
            "help": "check the written model against its source in its dtype: answers and text (the quick check)"
        },
    )


@dataclasses.dataclass
class ExportResult:
    """What an export wrote, and what the user should know about it."""

    output_dir: Path
    target: str
    files: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    quality: object | None = None  # `quick_check.QuickCheck` against the source folder, where it ran


@dataclasses.dataclass
class ExportJob:
    """One export in progress, handed to `ExportTarget.write`: the output tensors planned in writing order
    (name -> shape), and their stream."""

    checkpoint: object
    target: object
    folder: Path
    dtype: object  # torch dtype of the written weights
    plan: dict[str, tuple[int, ...]]
    progress: bool = True

    def tensors(self) -> Iterator[tuple[str, object]]:
        from tqdm.auto import tqdm

        stream = target_tensors(self.target, self.checkpoint)
        yield from tqdm(stream, total=len(self.plan), desc="export", unit="tensor", disable=not self.progress)


def target_tensors(target, checkpoint, meta: bool = False) -> Iterator[tuple[str, object]]:
    """The target's tensors, reading the checkpoint one tensor at a time (`meta`: shapes only, nothing read)."""
    import torch

    from ..checkpoints.writer import read_shapes

    shapes = read_shapes(checkpoint.path) if meta else None
    yield from target.extra_tensors()
    for name in sorted(checkpoint.names(), key=tensor_order):
        if is_unused_at_inference(name):
            continue
        tensor = torch.empty(shapes[name], device="meta") if meta else checkpoint.tensor(name)
        for role, layer, part in checkpoint_roles(target.config, name, tensor):
            yield from target.role_tensors(role, layer, part)


def export_model(
    model, to: str, output, *, overwrite=False, dtype: str | None = None, progress=True, eval=True, **options
) -> ExportResult:
    """Export the converted model folder `model` exactly into target `to` (`TARGETS`: mixtral, qwen2_moe, gguf),
    writing the folder `output`; `options`: the target's options by name. What the target cannot express exactly
    is refused with one ValueError, and nothing is written.

        export_model("smollm2-moe", "mixtral", "smollm2-mixtral")
        export_model("smollm2-moe", "gguf", "smollm2-gguf", dtype="bfloat16", tokenizer_pre="smollm")
        export_model("default", "gguf", "smollm2-gguf")   # the dense default model, to compare in the same engine

    With `eval`, a folder transformers loads is checked against the source (`check_export`) before it is renamed.
    """
    import torch

    from ..checkpoints.atomic import atomic_folder
    from ..checkpoints.converted import open_checkpoint
    from ..conversion.pipeline import check_not_source, check_output
    from ..loading import DEFAULT_MODEL, model_folder
    from ..registry import option_names
    from .checkpoint import check_compensation

    target_class = TARGETS[to]
    unknown = sorted(set(options) - option_names(target_class))
    if unknown:
        raise ValueError(f"Export target {to!r} has no options {unknown}.")
    run = ExportOptions(to=to, output=str(output), overwrite=overwrite, dtype=dtype, progress=progress, eval=eval)
    check_dtype(dtype)
    destination = check_output(run)  # the same rules and messages as `convert`
    checkpoint = open_checkpoint(model_folder(model) if str(model) == DEFAULT_MODEL else model)
    check_not_source(destination, checkpoint)
    target = target_class(checkpoint.config, target_class.Options(**options))
    target.check()
    target.notes += check_compensation(checkpoint)
    plan = {name: tuple(tensor.shape) for name, tensor in target_tensors(target, checkpoint, meta=True)}
    weights_dtype = getattr(torch, dtype) if dtype else checkpoint.dtype
    with atomic_folder(destination) as tmp:
        files = target.write(ExportJob(checkpoint, target, tmp, weights_dtype, plan, progress))
        quality = check_export(tmp, checkpoint, progress) if eval else None
    return ExportResult(destination, to, files, target.notes, quality)


def check_export(folder: Path, checkpoint, progress: bool = True):
    """The quick check of an exported folder against the folder it was exported from (None where transformers
    cannot load the output, or the source has no tokenizer: said in the log)."""
    import logging

    import torch

    from ..checkpoints.writer import read_shapes
    from ..conversion.pipeline import run_quick_check

    log = logging.getLogger(__name__)
    if not (folder / "config.json").is_file():
        log.info("Not checked here (transformers does not run this file): compare it with its source in its engine.")
        return None

    def load_source(dtype, device):
        from transformers import AutoModelForCausalLM

        import llama_moe_hf  # noqa: F401  (registers the families with the Auto classes)

        return AutoModelForCausalLM.from_pretrained(checkpoint.path, dtype=dtype or torch.float32).to(device)

    total = sum(math.prod(shape) for shape in read_shapes(folder).values())
    return run_quick_check(
        folder, load_source, checkpoint.load_tokenizer, total, progress=progress, reference="its source folder"
    )
