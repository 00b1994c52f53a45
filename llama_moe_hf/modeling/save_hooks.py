"""What a model of this package does when it is saved, besides transformers' own `save_pretrained`: every head of
the family in `auto_map`, the model saved as its own class under FSDP2's wrapper class, the written files' usual
permissions, and the hooks the installed package registers (the training card of a `trl sft` run).

This file is copied next to saved checkpoints (remote code): it imports only the standard library.
"""

import os
import warnings


def _own_class(model) -> type:
    """The model's class in this package, under any subclass a wrapper made for it in torch (FSDP2)."""
    return next(cls for cls in type(model).__mro__ if not cls.__module__.startswith("torch."))


SAVE_HOOKS = "llama_moe_hf.model_saved"  # entry-point group: called as hook(model, save_directory, is_main_process)


def _run_save_hooks(model, save_directory, is_main_process: bool) -> None:
    """Call what the installed llama-moe-hf registers for saved models (the training card of a `trl sft` run: TRL
    runs the model code as remote code and never imports the package). A failing hook costs the card, not the save."""
    from importlib.metadata import entry_points

    for hook in entry_points(group=SAVE_HOOKS):
        try:
            hook.load()(model, save_directory, is_main_process=is_main_process)
        except Exception as error:  # noqa: BLE001 - the weights are saved; say why the extra files are not
            warnings.warn(f"{hook.value} did not run after the save to {save_directory}: {error}", stacklevel=3)


def _file_stamps(folder) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every regular file directly in `folder`, which may not exist yet."""
    if not os.path.isdir(folder):
        return {}
    return {
        entry.name: (entry.inode(), entry.stat().st_mtime_ns)
        for entry in os.scandir(folder)
        if entry.is_file(follow_symlinks=False)
    }


def _chmod_written_files(folder, before: dict[str, tuple[int, int]]) -> None:
    """Give the files written in `folder` since `before` the mode a plain `open` gives, `0o666 & ~umask`:
    safetensors writes the weights through a 0600 temporary file, and `trl sft` saves without us touching them."""
    umask = os.umask(0)  # reading the umask means setting it: put it back at once
    os.umask(umask)
    for name, stamp in _file_stamps(folder).items():
        if before.get(name) != stamp:
            os.chmod(os.path.join(folder, name), 0o666 & ~umask)


class SaveWithHooksMixin:
    """`save_pretrained` and `add_auto_map` of every family's pretrained base (listed before `PreTrainedModel`);
    the family names its heads in `auto_heads` (Auto class -> head class in the family's modeling file)."""

    auto_heads: dict[str, str] = {}

    def add_auto_map(self) -> None:
        """Name every head of the family in `config.auto_map` (transformers would name only the saved class)."""
        module = type(self).__module__.rsplit(".", 1)[-1]
        heads = {auto: f"{module}.{name}" for auto, name in self.auto_heads.items()}
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **heads}

    def save_pretrained(self, save_directory, *args, **kwargs):
        # FSDP2's `fully_shard` swaps in a subclass made in torch (`FSDPLlamaMoEForCausalLM`); transformers would copy
        # torch's files as the model code and name that class in `auto_map`. Saved as our own class, for the save.
        wrapper, self.__class__ = self.__class__, _own_class(self)
        try:
            self.add_auto_map()
            before = _file_stamps(save_directory)
            result = super().save_pretrained(save_directory, *args, **kwargs)
            _chmod_written_files(save_directory, before)
        finally:
            self.__class__ = wrapper
        _run_save_hooks(self, save_directory, kwargs.get("is_main_process", True))
        return result
