"""Commands that read a model (`chat`, `info`, `eval`, `analyze`) take a folder, a Hub id (through the download seam,
as huggingface_hub's cache would give it) or `default`; `chat` computes in the checkpoint's dtype (float32 on a CPU without bf16 instructions) and streams."""

import pytest
import torch
from helpers import save_tiny_moe, save_tiny_source

from llama_moe.chat import chat
from llama_moe.checkpoints import open_source
from llama_moe.commands import main
from llama_moe.commands.info import info_lines
from llama_moe.loading import load_model, model_folder


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("loading")
    save_tiny_moe(root / "fp32")
    model = save_tiny_moe(root / "bf16").to(torch.bfloat16)
    model.save_pretrained(root / "bf16")
    return {"fp32": root / "fp32", "bf16": root / "bf16"}


def fake_download(folder, asked: list):
    def download(repo_id, **kwargs):
        asked.append(repo_id)
        return str(folder)

    return download


@pytest.mark.parametrize("bf16_instructions", [True, False])
def test_auto_dtype_is_the_checkpoints_own_unless_the_cpu_lacks_bf16(tiny_folders, monkeypatch, bf16_instructions):
    # On a CPU without bf16 instructions bfloat16 decodes 2.3x slower: `auto` computes in float32 there
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bf16_instructions, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    expected = torch.bfloat16 if bf16_instructions else torch.float32
    assert load_model(str(tiny_folders["bf16"]), device="cpu")[0].dtype == expected
    assert load_model(str(tiny_folders["bf16"]), dtype="bfloat16")[0].dtype == torch.bfloat16
    assert load_model(str(tiny_folders["fp32"]))[0].dtype == torch.float32
    from transformers import AutoModelForCausalLM

    class Loaded:  # stands in for a model on a GPU: only the dtype asked for matters
        def to(self, device):
            return self

        def eval(self):
            return self

    asked = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, dtype, **k: asked.append(dtype) or Loaded())
    load_model(str(tiny_folders["bf16"]), device="cuda:0")
    assert asked == ["auto"]  # an accelerator: the checkpoint's own
    with pytest.raises(ValueError, match="--dtype must be one of"):
        load_model(str(tiny_folders["fp32"]), dtype="float8")


def test_hub_ids_resolve_through_the_download_seam(tiny_folders):
    asked = []
    download = fake_download(tiny_folders["fp32"], asked)
    assert model_folder("me/tiny", download=download) == tiny_folders["fp32"]
    assert info_lines("me/tiny", download=download)[0].startswith("me/tiny: LlamaMoEConfig")
    assert asked == ["me/tiny", "me/tiny"]
    with pytest.raises(FileNotFoundError, match="not a Hub repository id"):
        model_folder("not/a/repo/id")
    (tiny_folders["fp32"].parent / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        model_folder(str(tiny_folders["fp32"].parent / "empty"))


def test_chat_streams_the_answer_it_returns(tiny_folders, capsys):
    answer = chat("me/tiny", "hi", max_new_tokens=6, stream=True, download=fake_download(tiny_folders["bf16"], []))
    assert capsys.readouterr().out.strip() == answer and answer


def test_chat_command_flags(tiny_folders, capsys):
    folder = str(tiny_folders["fp32"])
    assert main(["chat", folder, "--prompt", "hi", "--max-new-tokens", "4", "--dtype", "bfloat16", "--no-stream"]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["chat", folder, "--prompt", "hi", "--dtype", "int3"]) == 2
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["chat", "info", "eval", "analyze", "upgrade"])
def test_every_flag_has_help_text(command):
    from llama_moe.commands import build_parser

    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    actions = [a for a in subparsers.choices[command]._actions if a.dest != "help"]
    assert actions and all(action.help for action in actions), [a.dest for a in actions if not a.help]


@pytest.mark.smoke
def test_card_lines_load_the_tokenizer_without_the_package_and_without_a_prompt(tiny_folders):
    """What the card and README tell a user without the package, run in a fresh process where the package cannot be
    imported and no one answers a prompt."""
    import subprocess
    import sys

    script = (
        "import sys; sys.modules['llama_moe_hf'] = sys.modules['llama_moe'] = None\n"
        "from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast\n"
        "tokenizer = PreTrainedTokenizerFast.from_pretrained(sys.argv[1])\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)\n"
        "print(type(model).__name__, tokenizer('ab')['input_ids'])\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, str(tiny_folders["fp32"])],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[0] == "LlamaMoEForCausalLM"
    assert "[y/N]" not in run.stdout + run.stderr and "model of type" not in run.stderr
    assert run.stdout.split(maxsplit=1)[1].strip() == "[67, 68]"  # the character tokenizer: "a", "b"


def test_what_the_card_says_of_autotokenizer_without_the_package(tiny_folders):
    """AutoTokenizer reads the config first, which is remote code without the package: in a script with no input it
    prints the prompt and transformers' warning, then loads the same tokenizer. The card says so in one line."""
    import subprocess
    import sys

    from llama_moe.hub.card import usage_section

    script = (
        "import sys; sys.modules['llama_moe_hf'] = sys.modules['llama_moe'] = None\n"
        "from transformers import AutoTokenizer\n"
        "print(AutoTokenizer.from_pretrained(sys.argv[1])('ab')['input_ids'])\n"
    )
    command = [sys.executable, "-c", script, str(tiny_folders["fp32"])]
    run = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("[67, 68]"), run.stderr
    assert "[y/N]" in run.stdout + run.stderr and "a model of type ``" in run.stderr
    usage = " ".join(usage_section("me/model").split())
    assert "it asks `[y/N]`, and in a script with no input it prints that prompt" in usage


def test_hub_id_resolves_from_huggingface_hubs_local_cache(tiny_folders, tmp_path):
    """The real `snapshot_download`, offline, on a cache laid out as huggingface_hub writes it."""
    import functools
    import shutil

    from huggingface_hub import snapshot_download

    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--me--tiny"
    shutil.copytree(tiny_folders["fp32"], repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    download = functools.partial(snapshot_download, cache_dir=tmp_path / "hub", local_files_only=True)
    assert model_folder("me/tiny", download=download) == repo / "snapshots" / revision
    assert info_lines("me/tiny", download=download)[0].startswith("me/tiny: LlamaMoEConfig")
    with pytest.raises(FileNotFoundError, match="could not be downloaded"):
        model_folder("me/absent", download=download)


def test_a_folders_shapes_come_from_the_headers_without_reading_a_tensor(tmp_path):
    model = save_tiny_source(tmp_path / "dense", "llama")
    source = open_source(str(tmp_path / "dense"))
    unread = {file: set(names) for file, names in source._unread.items()}
    shapes = {name: source.shape(name) for name in source.names()}
    assert shapes == {name: tuple(t.shape) for name, t in model.state_dict().items() if name in shapes}
    assert source._unread == unread  # nothing was read: a merge checks its models' shapes before its forecast
