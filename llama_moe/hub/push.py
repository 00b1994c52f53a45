"""Upload a converted folder to the Hugging Face Hub with our model card, made for the repository pushed to.

`PreTrainedModel.push_to_hub` would replace README.md with a generic card, so the folder's files and the card are
uploaded in one commit: `create_repo(exist_ok=True)` + `create_commit` (the card as pushed adds the folder's
evaluation results and routing plots, `card.card_for_repo`; the local README.md is left as it is).
"""

from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi

from .card import card_for_repo


@dataclass
class PushPlan:
    """What a push uploads: (relative path, size in bytes) per file, and the model card text."""

    folder: Path
    repo_id: str
    private: bool
    files: list[tuple[str, int]]
    card: str

    def describe(self) -> str:
        visibility = "private" if self.private else "public"
        lines = [f"Would upload {len(self.files)} files from {self.folder} to {self.repo_id} ({visibility}):"]
        lines += [f"  {size:>15,d}  {name}" for name, size in self.files]
        lines += [f"  {sum(size for _, size in self.files):>15,d}  total bytes", "", "README.md:", self.card]
        return "\n".join(lines)


def plan_push(folder: str | Path, repo_id: str, private: bool = False) -> PushPlan:
    """Check that `folder` is a converted checkpoint and list what would be uploaded (hidden files are skipped)."""
    folder = Path(folder).expanduser().resolve()
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder; pass the output folder of `llama-moe convert`.")
    for required in ("config.json", "README.md"):
        if not (folder / required).is_file():
            raise FileNotFoundError(f"{folder} has no {required}; is it the output of `llama-moe convert`?")
    if not repo_id or repo_id.count("/") != 1:
        raise ValueError(f"--repo-id must look like 'org/name', got {repo_id!r}.")
    files = sorted(
        (p.relative_to(folder).as_posix(), p.stat().st_size)
        for p in folder.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts)
    )
    card = card_for_repo((folder / "README.md").read_text(encoding="utf-8"), folder, repo_id)
    return PushPlan(folder, repo_id, private, files, card)


def push_folder(
    folder: str | Path,
    repo_id: str,
    *,
    private: bool = False,
    token: str | None = None,
    commit_message: str = "Upload LlamaMoE model converted with llama-moe-hf",
    dry_run: bool = False,
    api: HfApi | None = None,
) -> PushPlan | str:
    """Create `repo_id` if needed and upload `folder` with its README.md. Returns the commit URL.

    With `dry_run=True` nothing is contacted and the `PushPlan` (files, sizes, card) is returned instead.
    `api` is the Hub client (default `HfApi(token=token)`); tests pass a fake one.
    """
    plan = plan_push(folder, repo_id, private)
    if dry_run:
        return plan
    api = api or HfApi(token=token)
    api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(plan.folder / name))
        for name, _ in plan.files
        if name != "README.md"
    ]
    operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=plan.card.encode("utf-8")))
    commit = api.create_commit(repo_id=repo_id, repo_type="model", operations=operations, commit_message=commit_message)
    return str(getattr(commit, "commit_url", commit))
