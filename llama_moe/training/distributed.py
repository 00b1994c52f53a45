"""Training over several processes as in one: how the recipes' Trainers spread the model, the line each run starts
with that says so, and a balance loss whose weight does not grow with the processes or the accumulation steps.

accelerate 1.15 turns FSDP on only for accelerator devices: on CPU processes (gloo) it sets `MULTI_CPU` and drops
the FSDP plugin without a word, so `--fsdp` silently became DDP. `DistributedTrainingMixin` switches such a run to
FSDP with the same plugin; accelerate's FSDP2 preparation (`fully_shard` per decoder layer, then the root) runs on
CPU unchanged.
At the start of training every recipe logs the distributed type and each process's share of the parameter bytes
(under FSDP2 or ZeRO-3 each holds about 1/world of them).

The balance loss: with `num_items_in_batch`, Trainer multiplies the model's loss by the number of processes (the
token mean is over every rank's tokens, and DDP averages the gradients) and no longer divides it by the accumulation
steps. Right for the LM loss; but the model's `loss` also holds `router_aux_loss_coef * aux_loss`, a mean over this
micro-batch, whose weight thus became coef x processes x accumulation steps (x8 on 8 GPUs). TRL's SFTTrainer adds
the term after that scaling, divided by the steps; `BalanceLossWeightMixin` does the same for the recipes' own
trainers (not for TRL's, which would then correct it twice).
"""

import logging
import os

from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class DistributedTrainingMixin:
    """For Trainer subclasses (list it first among the bases): FSDP on CPU processes as on GPUs, and the placement
    line at the start of training."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(PlacementReport())

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        plugin = _requested_fsdp_plugin(self.args)
        if plugin is not None and _is_multi_cpu(self.accelerator.state):
            _switch_to_fsdp(self.accelerator.state, plugin)
            self.is_fsdp_enabled = True


def _requested_fsdp_plugin(args):
    """The FSDP plugin the run asked for (Trainer's `--fsdp`, or `accelerate launch` with an FSDP config), or None."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    if args.fsdp_plugin_args is not None:
        return FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return FullyShardedDataParallelPlugin()
    return None


def _is_multi_cpu(state) -> bool:
    from accelerate.utils import DistributedType

    return state.distributed_type == DistributedType.MULTI_CPU


def _switch_to_fsdp(state, plugin) -> None:
    """What `AcceleratorState` does for FSDP on a GPU. Both shared states are set: a later `AcceleratorState()` copies
    `PartialState`'s distributed type over its own."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = PartialState().distributed_type = DistributedType.FSDP


class BalanceLossWeightMixin:
    """For Trainer subclasses whose loss is the model's own: `router_aux_loss_coef * aux_loss` at that weight per
    optimizer step, whatever the processes and accumulation steps (see the module)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, True, num_items_in_batch)
        aux = getattr(outputs, "aux_loss", None)
        if aux is not None and "labels" in inputs and self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            processes = self.accelerator.num_processes if self.args.average_tokens_across_devices else 1
            coef = self.accelerator.unwrap_model(model).config.router_aux_loss_coef
            weight_now, weight_meant = processes, 1 / self.current_gradient_accumulation_steps
            loss = loss - (weight_now - weight_meant) * coef * aux.to(loss.device)
        return (loss, outputs) if return_outputs else loss


def start_deepspeed_comm(training) -> None:
    """Before a model is loaded under DeepSpeed: ZeRO-3 builds it already partitioned inside `from_pretrained`
    (`zero.Init`), which takes the number of processes from DeepSpeed's own comm. accelerate starts that comm only for
    accelerator devices; on CPU processes it stayed unstarted and `zero.Init` saw one process (DeepSpeed:
    "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 4 != 2 * 1 * 1")."""
    if not training.deepspeed or training.world_size < 2:  # world_size sets up torch.distributed
        return
    import torch.distributed as dist
    from deepspeed import comm

    if dist.is_initialized() and not comm.is_initialized():
        comm.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)


class PlacementReport(TrainerCallback):
    """Logs, once the model is wrapped, the distributed type and the parameter bytes each process holds."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import torch.distributed as dist
        from accelerate.state import PartialState

        held, total = parameter_bytes(model)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        gathered = [held]
        if world > 1:
            gathered = [None] * world
            dist.all_gather_object(gathered, held)
        if state.is_world_process_zero:
            kind = PartialState().distributed_type.value
            shares = ", ".join(f"rank {rank} {_mb(b)} ({b / total:.0%})" for rank, b in enumerate(gathered))
            logger.warning(
                "Distributed type %s, %d process(es); parameter bytes of %s: %s", kind, world, _mb(total), shares
            )


def parameter_bytes(model) -> tuple[int, int]:
    """(bytes of parameters this process holds, bytes of the whole model's parameters). A DTensor (FSDP2) holds its
    local shard; a ZeRO-3 parameter holds its partition (`ds_tensor`) and reports its full size in `ds_numel`."""
    held = total = 0
    for parameter in model.parameters():
        if hasattr(parameter, "ds_tensor"):
            local, whole = parameter.ds_tensor.numel(), parameter.ds_numel
        else:
            local = parameter.to_local().numel() if hasattr(parameter, "to_local") else parameter.numel()
            whole = parameter.numel()
        held += local * parameter.element_size()
        total += whole * parameter.element_size()
    return held, total


def _mb(count: int) -> str:
    return f"{count / 2**20:.2f} MiB"
