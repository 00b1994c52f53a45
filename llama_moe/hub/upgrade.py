"""Bring a saved folder (converted or trained) up to the installed package: its remote code, `auto_map` and the model
card's Usage section, as this package writes them now; the weights are never read or touched.

A folder carries copies of the modeling files (remote code, for `trust_remote_code=True`). transformers releases
change what models must accept (5.24 renamed `past_key_values` to `cache`), and an old copy then loads but generates
garbage. The copy's version is the `LLAMA_MOE_VERSION` line of its configuration file, read without importing it;
copies written before that line existed are `UNVERSIONED`.
"""

import ast
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoints.atomic import replace_files

VERSION_FILE = "configuration_llama_moe.py"  # every family's code imports it, so every folder with code has it
UNVERSIONED = "0.1.0"
README = "README.md"
_SNIPPET_PREFIX = 'AutoModelForCausalLM.from_pretrained("'


@dataclass
class Upgrade:
    """What `upgrade_folder` found and did: every file it manages (name -> bytes as the installed package writes
    it), which of them differed from the folder's (`added`: those it did not have, such as the code files newer model
    code imports), and the commit URL when the changes were pushed."""

    folder: Path
    model_type: str
    old_version: str | None  # None: the folder carries no code
    files: dict[str, bytes]
    changed: list[str]
    added: list[str] = field(default_factory=list)
    dry_run: bool = False
    pushed: str | None = None

    @property
    def up_to_date(self) -> bool:
        return not self.changed

    def describe(self) -> str:
        version, requirement, tested = installed_code()
        runs_on = f"transformers {requirement}, tested with {' and '.join(tested)}"
        if self.up_to_date:
            lines = [f"{self.folder} is up to date (llama-moe-hf {version} code: {runs_on}); nothing changed"]
        else:
            old = f"llama-moe-hf {self.old_version}" if self.old_version else "no code"
            verb = "would upgrade" if self.dry_run else "upgraded"
            lines = [f"{verb} {self.folder}: {old} -> llama-moe-hf {version} ({runs_on})"]
            for name in self.changed:
                done = ("would add", "added") if name in self.added else ("would rewrite", "rewrote")
                lines.append(f"  {done[0] if self.dry_run else done[1]} {name}")
            lines.append("weights untouched")
        if self.pushed:
            lines.append(f"pushed: {self.pushed}")
        return "\n".join(lines)


def installed_code() -> tuple[str, str, tuple[str, ...]]:
    """(version, transformers requirement, transformers releases tested) of the installed package's model code."""
    from llama_moe_hf.modeling.configuration_llama_moe import (
        LLAMA_MOE_VERSION,
        TRANSFORMERS_REQUIREMENT,
        TRANSFORMERS_TESTED,
    )

    return LLAMA_MOE_VERSION, TRANSFORMERS_REQUIREMENT, TRANSFORMERS_TESTED


def code_version(folder: str | Path) -> str | None:
    """The llama-moe-hf version of the code a folder carries, parsed (never imported: it could be anything), or None
    when it carries no code. A copy without a version line, or one that cannot be parsed, is `UNVERSIONED`."""
    path = Path(folder) / VERSION_FILE
    if not path.is_file():
        return None
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return UNVERSIONED
    version = UNVERSIONED
    for node in tree.body:  # the last assignment wins, as when the module runs
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "LLAMA_MOE_VERSION" for t in targets):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                version = node.value.value
    return version


def _version(text: str):
    """A comparable version; one that does not parse counts as the oldest (`UNVERSIONED`): upgrading replaces it."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(text)
    except InvalidVersion:
        return Version(UNVERSIONED)


def code_status(folder: str | Path, name: str) -> str | None:
    """`llama-moe info`'s line about the folder's code against the installed package's (None: it has no code)."""
    version = code_version(folder)
    if version is None:
        return None
    installed, requirement, _ = installed_code()
    if _version(version) < _version(installed):
        local = Path(name).expanduser().is_dir()  # else a Hub id: its copy in the cache is not to be edited
        fix = f"`llama-moe upgrade {name}`" if local else f"`llama-moe upgrade DIR --push-to-hub --repo-id {name}`"
        return (
            f"code: llama-moe-hf {version}, older than the installed {installed} (which runs on transformers "
            f"{requirement}): run {fix}{'' if local else ' on a local copy'} to replace it (weights untouched)"
        )
    if _version(version) > _version(installed):
        return f"code: llama-moe-hf {version}, newer than the installed {installed}"
    return f"code: llama-moe-hf {version}, as installed (runs on transformers {requirement})"


def plan_upgrade(folder: str | Path) -> Upgrade:
    """What upgrading `folder` would write; reads only config.json, the code files and README.md."""
    folder = Path(folder).expanduser().resolve()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{folder} has no config.json; pass a folder written by `llama-moe convert` or a training recipe."
        )
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{folder / 'config.json'} is not valid JSON: {error}") from None
    config_class, base, module = _family(config.get("model_type"), folder)
    old_version, (version, _, _) = code_version(folder), installed_code()
    if old_version is not None and _version(old_version) > _version(version):
        raise ValueError(
            f"{folder} carries llama-moe-hf {old_version} code, newer than the installed {version}: "
            "upgrade the package instead."
        )
    files = code_files(config_class, module)
    files["config.json"] = _config_json(config, auto_map(config_class, base, module)) or _read(folder / "config.json")
    card = upgraded_card(folder)
    if card is not None:
        files[README] = card.encode("utf-8")
    changed = [name for name, data in files.items() if _read(folder / name) != data]
    added = [name for name in changed if not (folder / name).exists()]
    return Upgrade(folder, config_class.model_type, old_version, files, changed, added)


def _family(model_type, folder: Path):
    """(config class, pretrained base class, modeling module) of the family whose `model_type` this is."""
    from llama_moe_hf.modeling import MODEL_FAMILIES

    for config_class, (base, module) in MODEL_FAMILIES.items():
        if config_class.model_type == model_type:
            return config_class, base, module
    names = ", ".join(config_class.model_type for config_class in MODEL_FAMILIES)
    raise ValueError(f"{folder} holds a {model_type!r} model, not one of {names}; it has no code of ours to upgrade.")


def code_files(config_class, module) -> dict[str, bytes]:
    """The files `save_pretrained` copies for the family (`custom_object_save`): the config's and the modeling
    module's files and every file they import relatively, recursively (model code 0.4.0 split the kernels, router
    losses, routers, save hooks and cache shim into files of their own, which an older folder lacks)."""
    from transformers.dynamic_module_utils import get_relative_import_files

    files = {}
    for main in (sys.modules[config_class.__module__].__file__, module.__file__):
        for path in (main, *get_relative_import_files(main)):
            files[Path(path).name] = Path(path).read_bytes()
    return dict(sorted(files.items()))


def auto_map(config_class, base, module) -> dict[str, str]:
    """The config's and every head's `auto_map` entry (as `save_pretrained` with `add_auto_map` writes them)."""
    config_module = config_class.__module__.rsplit(".", 1)[-1]
    model_module = module.__name__.rsplit(".", 1)[-1]
    heads = {auto: f"{model_module}.{name}" for auto, name in base.auto_heads.items()}
    return {"AutoConfig": f"{config_module}.{config_class.__name__}", **heads}


def _config_json(config: dict, entries: dict[str, str]) -> bytes | None:
    """config.json with `entries` in its `auto_map` (formatted as transformers writes it), or None if it has them."""
    wanted = {**(config.get("auto_map") or {}), **entries}
    if config.get("auto_map") == wanted:
        return None
    return (json.dumps({**config, "auto_map": wanted}, indent=2, sort_keys=True) + "\n").encode("utf-8")


def upgraded_card(folder: Path) -> str | None:
    """README.md with its Usage section (loading snippet, code version, transformers releases) as the installed
    package writes it, for the repository its snippet names; None when there is no card of ours (no snippet)."""
    from .card import absolute_doc_links, has_tokenizer, replace_section, usage_section

    path = folder / README
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    start = text.find("\n## Usage\n")
    snippet = text.find(_SNIPPET_PREFIX, start) if start >= 0 else -1
    if snippet < 0:
        return None  # a card written by hand: left as it is
    model_id = text[snippet + len(_SNIPPET_PREFIX) :].split('"', 1)[0]
    usage = usage_section(model_id, tokenizer=has_tokenizer(folder), source=_base_model(text))
    return absolute_doc_links(replace_section(text, "## Usage", usage))


def _base_model(card_text: str) -> str | None:
    from huggingface_hub import ModelCard

    try:
        return ModelCard(card_text).data.base_model
    except (ValueError, TypeError):  # metadata that does not parse: no source to name
        return None


def _read(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() else None


def upgrade_folder(
    folder: str | Path,
    *,
    repo_id: str | None = None,
    token: str | None = None,
    dry_run: bool = False,
    api=None,
) -> Upgrade:
    """Upgrade `folder` in place (`plan_upgrade`, then `replace_files`: as it was or fully upgraded, never half), and
    with `repo_id` upload the changed files in one commit (an up-to-date folder uploads the files the upgrade manages,
    so a failed upload can be retried). `api`: the Hub client (default `HfApi(token=token)`); tests pass a fake one.
    `dry_run`: change and contact nothing."""
    plan = plan_upgrade(folder)
    plan.dry_run = dry_run
    if repo_id is not None and (not repo_id or repo_id.count("/") != 1):
        raise ValueError(f"--repo-id must look like 'org/name', got {repo_id!r}.")
    if dry_run:
        return plan
    if plan.changed:
        replace_files(plan.folder, {name: plan.files[name] for name in plan.changed})
    if repo_id is not None:
        plan.pushed = _push(plan, repo_id, token, api)
    return plan


def _push(plan: Upgrade, repo_id: str, token: str | None, api) -> str:
    from huggingface_hub import CommitOperationAdd, HfApi

    from .card import card_for_repo

    version = installed_code()[0]
    operations = []
    for name in plan.changed or list(plan.files):
        data = plan.files[name]
        if name == README:  # the card as `llama-moe push` makes it for the repository
            data = card_for_repo(data.decode("utf-8"), plan.folder, repo_id).encode("utf-8")
        operations.append(CommitOperationAdd(path_in_repo=name, path_or_fileobj=data))
    try:
        commit = (api or HfApi(token=token)).create_commit(
            repo_id=repo_id,
            repo_type="model",
            operations=operations,
            commit_message=f"Upgrade the model code to llama-moe-hf {version}",
        )
    except Exception as error:  # the Hub client's errors are of many kinds; the folder itself is done
        raise OSError(
            f"{plan.folder} is upgraded, but the upload to {repo_id} failed ({error}); run the command again to retry."
        ) from error
    return str(getattr(commit, "commit_url", commit))
