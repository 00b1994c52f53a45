"""`llama-moe upgrade`: a folder written by older code (its code files from git, before transformers 5.24's `cache`,
and without the files model code 0.4.0 split out of the modeling files) gets the current code files, `auto_map` and
card, all or nothing, weights untouched; the upgraded folder runs as remote code without the package; `info` tells an
old folder to upgrade; `--push-to-hub` uploads only the changed files."""

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import (
    FAMILY_FIELDS,
    FakeHfApi,
    interrupt_the_second_replace,
    load_as_remote_code,
    run_generation_script,
    tiny_family_model,
)
from transformers import AutoModelForCausalLM

import llama_moe.hub.upgrade as upgrade
from llama_moe.commands import main
from llama_moe.hub.card import code_text
from llama_moe_hf import convert_to_moe
from llama_moe_hf.modeling.configuration_llama_moe import LLAMA_MOE_VERSION

REPO = Path(__file__).parents[2]
OLD_COMMIT = "607b389"  # the last commit whose model code took `past_key_values` (and carried no version line)
OLD_FILES = ("configuration_", "modeling_")  # before 0.4.0 a folder's code files were these (one per family)
PROMPT = [[5, 17, 33, 60, 2, 99, 41, 7]]


def old_code(name: str) -> bytes:
    """Model code file `name` as commit 607b389 wrote it; without the git history (a source archive) the current file
    without its version line stands in (an unversioned copy all the same)."""
    try:
        show = ["git", "show", f"{OLD_COMMIT}:llama_moe_hf/modeling/{name}"]
        return subprocess.run(show, cwd=REPO, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        current = (REPO / "llama_moe_hf" / "modeling" / name).read_text().splitlines(keepends=True)
        return "".join(line for line in current if not line.startswith("LLAMA_MOE_VERSION")).encode()


def make_old(folder: Path) -> None:
    """Turn a folder written now into one written before: old code (the configuration and modeling files only), an
    `auto_map` naming only the causal LM, and a card whose Usage section does not say which code and transformers
    releases it carries."""
    for path in folder.glob("*.py"):
        if path.name.startswith(OLD_FILES):
            path.write_bytes(old_code(path.name))
        else:
            path.unlink()
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {key: config["auto_map"][key] for key in ("AutoConfig", "AutoModelForCausalLM")}
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    card = folder / "README.md"
    if card.is_file():
        text = card.read_text()
        assert code_text() in text
        card.write_text(text.replace(code_text() + "\n\n", ""))


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def stamps(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()}


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_dense):
    """A folder `llama-moe convert` writes now (code, auto_map, card, tokenizer): the upgrade's target."""
    out = tmp_path_factory.mktemp("upgrade") / "tiny-moe"
    convert_to_moe(tiny_dense[0], out, num_experts=4, top_k=2, eval=False, progress=False)
    return out


@pytest.fixture
def old(converted, tmp_path):
    folder = tmp_path / "tiny-moe"
    shutil.copytree(converted, folder)
    make_old(folder)
    return folder


def test_upgrade_restores_code_auto_map_and_card_and_keeps_the_weights(converted, old, capsys):
    weights = old / "model.safetensors"
    inode, digest = weights.stat().st_ino, hashlib.sha256(weights.read_bytes()).hexdigest()
    assert main(["upgrade", str(old), "--dry-run"]) == 0
    assert "would rewrite modeling_llama_moe.py" in capsys.readouterr().out and contents(old) != contents(converted)

    assert main(["upgrade", str(old)]) == 0
    out = capsys.readouterr().out
    assert f"upgraded {old}: llama-moe-hf 0.1.0 -> llama-moe-hf {LLAMA_MOE_VERSION}" in out
    for name in ("configuration_llama_moe.py", "modeling_llama_moe.py", "config.json", "README.md"):
        assert f"rewrote {name}" in out
    for name in ("moe_kernels.py", "router_losses.py", "routers.py", "save_hooks.py", "cache_compat.py"):
        assert f"added {name}" in out  # the files 0.4.0 split out of the modeling file
    assert contents(old) == contents(converted)  # every file as a conversion writes it now, nothing left behind
    assert sorted(os.listdir(old)) == sorted(os.listdir(converted))
    assert weights.stat().st_ino == inode and hashlib.sha256(weights.read_bytes()).hexdigest() == digest

    before = stamps(old)
    assert main(["upgrade", str(old)]) == 0
    assert "is up to date" in capsys.readouterr().out and stamps(old) == before


V036_COMMIT = "f29ee22"  # model code 0.3.6, the last with one modeling file per family


def test_a_folder_of_model_code_0_3_6_gets_the_files_0_4_0_split_out_and_loads_without_the_package(converted, tmp_path):
    """0.3.6 code in configuration_llama_moe.py and modeling_llama_moe.py alone: the upgrade adds every file the new
    modeling file imports relatively (`code_files`), and the folder loads as remote code in a fresh process."""
    folder = tmp_path / "v036"
    shutil.copytree(converted, folder)
    for path in folder.glob("*.py"):
        show = ["git", "show", f"{V036_COMMIT}:llama_moe_hf/modeling/{path.name}"]
        try:
            old = subprocess.run(show, cwd=REPO, capture_output=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            if path.name.startswith(OLD_FILES):
                pytest.skip("needs the git history (model code 0.3.6)")
            path.unlink()  # a file 0.3.6 did not have
        else:
            path.write_bytes(old)
    assert upgrade.code_version(folder) == "0.3.6" and not (folder / "moe_kernels.py").exists()
    result = upgrade.upgrade_folder(folder)
    config_class, _, module = upgrade._family("llama_moe", folder)
    expected = set(upgrade.code_files(config_class, module))
    assert {"moe_kernels.py", "router_losses.py", "routers.py", "save_hooks.py", "cache_compat.py"} <= expected
    assert set(result.added) == expected - {"configuration_llama_moe.py", "modeling_llama_moe.py"}
    assert "0.3.6 -> llama-moe-hf " + LLAMA_MOE_VERSION in result.describe()
    assert contents(folder) == contents(converted)
    ids = torch.tensor(PROMPT)
    module, remote_logits = load_as_remote_code(folder, ids)
    assert module.startswith("transformers_modules")
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(remote_logits, model(ids).logits[0, -1], atol=1e-5, rtol=1e-4)


def test_an_interrupted_upgrade_leaves_the_folder_as_it_was(old, monkeypatch):
    before = contents(old)
    interrupt_the_second_replace(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        upgrade.upgrade_folder(old)
    monkeypatch.undo()
    assert contents(old) == before and sorted(os.listdir(old)) == sorted(before)  # no temporary file either
    assert not upgrade.upgrade_folder(old).up_to_date and upgrade.plan_upgrade(old).up_to_date


@pytest.mark.smoke
def test_every_family_upgrades_and_generates_as_remote_code_with_the_cache(tmp_path):
    folders = []
    for family in FAMILY_FIELDS:
        current, folder = tmp_path / f"current-{family}", tmp_path / family
        tiny_family_model(family).save_pretrained(current)
        shutil.copytree(current, folder)
        make_old(folder)
        result = upgrade.upgrade_folder(folder)
        assert result.model_type == family and result.old_version == "0.1.0"
        assert contents(folder) == contents(current), family
        folders.append(folder)
    installed, remote = (run_generation_script(folders, PROMPT, *flags) for flags in ((), ("--remote-code",)))
    for folder in map(str, folders):
        assert remote[folder]["module"].startswith("transformers_modules"), folder
        assert remote[folder]["dynamic"] == remote[folder]["uncached"] == installed[folder]["uncached"], folder


def test_info_tells_an_old_folder_to_upgrade(old, capsys):
    assert main(["info", str(old)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"code: llama-moe-hf 0.1.0, older than the installed {LLAMA_MOE_VERSION}" in line
    assert f"run `llama-moe upgrade {old}`" in line
    upgrade.upgrade_folder(old)
    assert main(["info", str(old)]) == 0
    assert f"code: llama-moe-hf {LLAMA_MOE_VERSION}, as installed" in capsys.readouterr().out
    assert upgrade.code_version(old) == LLAMA_MOE_VERSION and upgrade.code_version(old.parent) is None


def test_push_uploads_only_the_changed_files_in_one_commit(old, capsys):
    api = FakeHfApi()
    result = upgrade.upgrade_folder(old, repo_id="me/tiny-moe", api=api)
    assert result.pushed == "https://huggingface.co/me/tiny-moe/commit/abc"
    assert [call[0] for call in api.calls] == ["create_commit"]
    assert set(api.uploaded) == set(result.changed) and "model.safetensors" not in api.uploaded
    assert api.uploaded["modeling_llama_moe.py"] == (old / "modeling_llama_moe.py").read_bytes()
    assert 'from_pretrained("me/tiny-moe", trust_remote_code=True)' in api.uploaded_readme  # made for the repository

    retry = FakeHfApi()  # up to date here, e.g. after a failed upload: the files the upgrade manages go up
    assert upgrade.upgrade_folder(old, repo_id="me/tiny-moe", api=retry).up_to_date
    assert {"config.json", "modeling_llama_moe.py", "README.md"} <= set(retry.uploaded)
    assert not any(name.endswith(".safetensors") for name in retry.uploaded)

    assert main(["upgrade", str(old), "--push-to-hub"]) == 2
    assert capsys.readouterr().err.strip() == "error: --push-to-hub needs --repo-id ORG/NAME."


def test_folders_that_are_not_ours_are_one_error_line(tmp_path, tiny_dense, old, capsys):
    (tmp_path / "empty").mkdir()
    newer = old / "configuration_llama_moe.py"
    newer.write_text(newer.read_text() + '\nLLAMA_MOE_VERSION = "99.0"\n')
    before = contents(old)
    cases = {
        str(tmp_path / "missing"): "has no config.json",
        str(tmp_path / "empty"): "has no config.json",
        str(tiny_dense[0]): "holds a 'llama' model, not one of llama_moe, attn_moe, soap_moe",
        str(old): "carries llama-moe-hf 99.0 code, newer than the installed",
    }
    for folder, message in cases.items():
        assert main(["upgrade", folder]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("error: ") and message in line, line
    assert contents(old) == before
