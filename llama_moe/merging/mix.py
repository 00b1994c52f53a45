"""A router-only Branch-Train-MiX MiX stage inside a merge (the `trained` gate): the routers of the merged folder
alone trained on the mixture of the expert models' data with the continual pre-training recipe (`train_routers_only`),
then the folder's router tensors replaced, every other tensor as the merge wrote it. It runs in the merge's temporary
folder, so an interrupted MiX leaves nothing."""

import tempfile
from pathlib import Path

from ..training.freezing import ROUTER_PARAMETER


def train_routers(folder, router, inputs) -> None:
    """Train the routers of the merged `folder` on the experts' data (`router`: the `trained` init, its options)."""
    from ..training import pretrain

    folder = Path(folder)
    domains = [f"expert{i}={expert.data}" for i, expert in enumerate(inputs.experts)]
    with tempfile.TemporaryDirectory(dir=folder, prefix=".mix-") as staging:
        args = pretrain.ContinualPretrainArguments(
            model_name_or_path=str(folder),
            domains=domains,
            seq_len=_seq_len(router),
            eval_blocks=2,
            train_routers_only=True,
            teacher_model_name_or_path="none",
        )
        outcome = pretrain.continual_pretrain(args, _training_arguments(router, staging, inputs.device))
        state = outcome.model.state_dict()
        replace_tensors(folder, {name: t for name, t in state.items() if ROUTER_PARAMETER in name})
        _copy_atomically(Path(outcome.output) / "training_history.json", folder / "training_history.json")


def _seq_len(router) -> int:
    positions = getattr(router.dense_config, "max_position_embeddings", None)
    return min(router.options.mix_seq_len, positions or router.options.mix_seq_len)


def _training_arguments(router, output_dir: str, device):
    import torch
    from transformers import TrainingArguments

    on_gpu = torch.cuda.is_available() and str(device or "cuda").startswith("cuda")
    return TrainingArguments(
        output_dir=output_dir,
        max_steps=router.options.mix_steps,
        learning_rate=router.options.mix_learning_rate,
        lr_scheduler_type="cosine",
        per_device_train_batch_size=router.options.mix_batch_size,
        per_device_eval_batch_size=router.options.mix_batch_size,
        weight_decay=0.0,
        eval_strategy="no",
        save_strategy="no",
        logging_steps=10,
        report_to="none",
        use_cpu=not on_gpu,
        seed=router.recipe.seed,
        disable_tqdm=not getattr(router.run, "progress", True),
    )


def replace_tensors(folder: Path, tensors: dict) -> None:
    """Rewrite, one atomic file each, the safetensors shards of `folder` that hold any of `tensors` (each cast to the
    shard's dtype); every other tensor and the metadata stay as they are."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from ..checkpoints.atomic import atomic_file

    left = dict(tensors)
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as opened:
            names, metadata = set(opened.keys()), opened.metadata()
        if not names & set(left):
            continue
        weights = load_file(str(shard))
        for name in names & set(left):
            weights[name] = left.pop(name).detach().to(weights[name].dtype).contiguous()
        with atomic_file(shard) as tmp:
            save_file(weights, str(tmp), metadata=metadata)
    if left:
        raise ValueError(f"{folder} has no tensors {sorted(left)[:2]}...: not the merged model's weights.")


def _copy_atomically(source: Path, target: Path) -> None:
    from ..checkpoints.atomic import atomic_file

    with atomic_file(target) as tmp:
        tmp.write_bytes(source.read_bytes())
