"""Branch-Train-MiX's MiX stage: `train_routers_only` trains the MLP routers alone (a model without them is refused in
one line), and the `trained` gate runs it inside a merge: only the router tensors differ from the `expert_data`
merge it starts from, the loss on the experts' data mixture does not rise, and a failed MiX stage leaves nothing."""

import json
from pathlib import Path

import pytest
import torch
from helpers import char_tokenizer, save_tiny_source, tiny_llama, tiny_moe
from safetensors.torch import load_file

from llama_moe.conversion.settings import RunOptions
from llama_moe.merging.config import ExpertSource, MergeConfig
from llama_moe.merging.pipeline import merge
from llama_moe.training.freezing import train_routers_only

BLOCK = 64
RECIPES = Path(__file__).parents[2] / "recipes"


def test_train_routers_only_leaves_only_the_routers_trainable():
    model = tiny_moe()
    trained = train_routers_only(model)
    names = [name for name, param in model.named_parameters() if param.requires_grad]
    assert names and all(".mlp.gate." in name for name in names)
    assert trained == sum(param.numel() for name, param in model.named_parameters() if name in names)


def test_a_model_without_routers_is_refused_in_one_line():
    with pytest.raises(ValueError, match="no MLP routers") as error:
        train_routers_only(tiny_llama())
    assert "\n" not in str(error.value)


MIX = {"mix_steps": 20, "mix_learning_rate": 0.05}  # a tiny model's routers need a larger step to move the loss


@pytest.fixture(scope="module")
def merged_pair(tmp_path_factory, domains):
    """(folder of the expert_data merge, folder of the trained merge): 2 tiny llama experts, top-2, averaged."""
    root = tmp_path_factory.mktemp("btx")
    save_tiny_source(root / "base", "llama", seed=0)
    experts = []
    for i, (name, path) in enumerate(sorted(domains.items())):
        save_tiny_source(root / name, "llama", seed=1 + i)
        experts.append(ExpertSource(str(root / name), data=path))
    folders = []
    for gate in ("expert_data", "trained"):
        config = MergeConfig(
            experts=tuple(experts),
            base_model=str(root / "base"),
            gate_mode=gate,
            non_ffn="average",
            gate_tokens=512,
            gate_options=MIX if gate == "trained" else {},
        )
        folders.append(merge(config, RunOptions(output=str(root / gate), progress=False, eval=False)).output_dir)
    return folders


def test_the_trained_gate_changes_only_the_router_tensors(merged_pair):
    before, after = (load_file(str(folder / "model.safetensors")) for folder in merged_pair)
    assert before.keys() == after.keys()
    changed = sorted(name for name in before if not torch.equal(before[name], after[name]))
    routers = sorted(name for name in before if ".mlp.gate." in name)
    assert changed == routers and routers
    history = json.loads((merged_pair[1] / "training_history.json").read_text())
    assert history[-1]["trained"] == "routers" and history[-1]["steps"] == MIX["mix_steps"]
    assert not [p for p in merged_pair[1].iterdir() if p.name.startswith(".")]


def mixture_loss(folder, domains) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer, losses = char_tokenizer(), []
    for path in domains.values():
        texts = [json.loads(line)["text"] for line in Path(path).read_text().splitlines()][:40]
        ids = torch.tensor(tokenizer("\n".join(texts))["input_ids"])
        blocks = ids[: len(ids) // BLOCK * BLOCK].view(-1, BLOCK)[:16]
        with torch.no_grad():
            losses.append(model(blocks, labels=blocks).loss.item())
    return sum(losses) / len(losses)


def test_the_mix_stage_lowers_the_mixture_loss(merged_pair, domains):
    before, after = (mixture_loss(folder, domains) for folder in merged_pair)
    assert after < before, (before, after)  # random tiny experts: routing moves the loss little


def test_a_failed_mix_stage_leaves_nothing(tmp_path, domains, monkeypatch):
    from llama_moe.training import pretrain

    def fails(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(pretrain, "continual_pretrain", fails)
    save_tiny_source(tmp_path / "base", "llama")
    expert = ExpertSource(str(tmp_path / "base"), data=domains["prose"])
    config = MergeConfig(experts=(expert,), base_model=str(tmp_path / "base"), gate_mode="trained", experts_per_token=1)
    with pytest.raises(RuntimeError, match="interrupted"):
        merge(config, RunOptions(output=str(tmp_path / "out"), progress=False, eval=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]


def test_the_btx_recipe_files_parse():
    from transformers import TrainingArguments
    from trl import TrlParser

    from llama_moe.merging.config import config_from_dict, read_yaml
    from llama_moe.training.pretrain import ContinualPretrainArguments

    parser = TrlParser((ContinualPretrainArguments, TrainingArguments))
    args, training = parser.parse_args_and_config(["--config", str(RECIPES / "pretrain/btx-mix.yaml"), "--use_cpu"])
    assert not args.train_routers_only and not args.train_moe_only and training.max_steps == 120
    for domain in ("prose", "code", "math"):
        args, training = parser.parse_args_and_config(["--config", str(RECIPES / f"btx/branch-{domain}.yaml")])
        assert args.domains == [f"{domain}=data/offline/pretrain/{domain}/train.jsonl"] and training.max_steps == 40
    merged = config_from_dict(read_yaml(RECIPES / "btx/merge.yaml"))
    assert (merged.gate_mode, merged.non_ffn, merged.experts_per_token) == ("expert_data", "average", 2)


def test_the_recipe_refuses_train_routers_only_on_a_dense_model_before_it_loads(tmp_path):
    from llama_moe.training.pretrain import ContinualPretrainArguments, _check_moe_only

    save_tiny_source(tmp_path / "dense", "llama")
    args = ContinualPretrainArguments(str(tmp_path / "dense"), domains=["a=b"], train_routers_only=True)
    with pytest.raises(ValueError, match="train_routers_only: .* is a llama model") as error:
        _check_moe_only(args)
    assert "\n" not in str(error.value)
