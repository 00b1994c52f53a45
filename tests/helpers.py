"""Shared test helpers: tiny dense models and their files, and small checks. Test modules import from here (and
fixtures come from conftest.py); they never import each other."""

import hashlib
import json
import runpy
import subprocess
import sys
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from llama_moe.conversion.calibration import CalibrationContext
from llama_moe.conversion.plan import ConversionPlan
from llama_moe.source_families import dense_config_fields, source_family
from llama_moe_hf import (
    AttnMoEConfig,
    AttnMoEForCausalLM,
    LlamaMoEConfig,
    LlamaMoEForCausalLM,
    MoERecipe,
    SoapMoEConfig,
    SoapMoEForCausalLM,
)

TINY_VOCAB = 128


# The shape of every tiny dense model: 8 query heads over 2 KV heads (GQA)
TINY_FIELDS = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def tiny_llama_config(**overrides) -> LlamaConfig:
    """A small dense LLaMA config (`TINY_FIELDS`)."""
    return LlamaConfig(**(TINY_FIELDS | overrides))


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A seeded random model of `tiny_llama_config(**overrides)`, in eval mode."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


def tiny_moe(seed: int = 0, **moe_fields) -> LlamaMoEForCausalLM:
    """A tiny random LlamaMoE (GQA, 2 layers, 4 experts of 24, top-2 by default), in eval mode."""
    torch.manual_seed(seed)
    fields = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24} | moe_fields
    return LlamaMoEForCausalLM(LlamaMoEConfig(**dense_config_fields(tiny_llama_config()), **fields)).eval()


# Tiny dense models of every source family, each with its distinctive features on (tests/conversion/test_source_families.py)
# One tiny model per family, with each family's expert-parallel and sharding-relevant parts on (the scale-out tests
# and tests/scripts/scale_out_script.py)
SCALE_OUT_FAMILIES = {
    "llama_moe": (LlamaMoEForCausalLM, LlamaMoEConfig, dict(num_experts=4, num_experts_per_tok=2)),
    "attn_moe": (
        AttnMoEForCausalLM,
        AttnMoEConfig,
        dict(num_attention_experts=4, num_attention_experts_per_tok=2, attention_experts_implementation="gathered"),
    ),
    "soap_moe": (SoapMoEForCausalLM, SoapMoEConfig, dict(num_experts=4, segment_length=8)),
}


def scale_out_model(family: str = "llama_moe"):
    model_class, config_class, fields = SCALE_OUT_FAMILIES[family]
    torch.manual_seed(0)
    config = config_class(
        **dense_config_fields(tiny_llama_config()), moe_intermediate_size=24, output_router_logits=False, **fields
    )
    return model_class(config)


SOURCE_FIELDS = TINY_FIELDS | dict(bos_token_id=1, eos_token_id=1, pad_token_id=0)  # ids within the vocabulary
WINDOW = 5  # shorter than the test sequences: the sliding-window layers see less than the full ones
FAMILY_CONFIGS = {
    "llama": (LlamaConfig, dict(attention_bias=True, rope_parameters={"rope_type": "linear", "factor": 2.0})),
    "mistral": (MistralConfig, dict(sliding_window=WINDOW, head_dim=12)),
    "qwen2": (Qwen2Config, dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3": (Qwen3Config, dict(head_dim=12, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "phi3": (Phi3Config, dict(partial_rotary_factor=0.5, sliding_window=WINDOW)),
}


def tiny_source(family: str, seed: int = 0, **overrides):
    """A seeded random dense model of `family` (its `FAMILY_CONFIGS` features, then `overrides`) whose norms and
    biases are random too (so q/k norms and biases matter), in eval mode."""
    config_class, fields = FAMILY_CONFIGS[family]
    config = config_class(**SOURCE_FIELDS, **(fields | overrides))
    torch.manual_seed(seed)
    model = source_family({"model_type": family}, family).model_class()(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.3 * torch.randn_like(param))
    return model.eval()


def save_tiny_source(path: Path, family: str, seed: int = 0, **overrides):
    """`tiny_source` saved as safetensors with a character tokenizer; returns the model."""
    model = tiny_source(family, seed, **overrides)
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return model


def char_tokenizer():
    """A character-level tokenizer whose ids fit the tiny models' vocabulary (ASCII 32..126, <unk>, </s>)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{chr(c): i + 2 for i, c in enumerate(range(32, 127))}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")


def save_tiny_dense(path: Path, seed: int = 0, **save_kwargs) -> LlamaForCausalLM:
    """A tiny random GQA LLaMA saved as safetensors with a character tokenizer; returns the model (fp32, eval)."""
    model = tiny_llama(seed)
    model.save_pretrained(path, **save_kwargs)
    char_tokenizer().save_pretrained(path)
    return model


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def save_tiny_moe(path: Path, seed: int = 0, **moe_fields) -> LlamaMoEForCausalLM:
    """`tiny_moe` saved with a character tokenizer that has a chat template (a converted checkpoint to train)."""
    model = tiny_moe(seed, **moe_fields)
    model.save_pretrained(path)
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return model


def token_batch(batch_size: int = 2, length: int = 12, vocab_size: int = TINY_VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab_size, (batch_size, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, input_ids) -> torch.Tensor:
    return model(input_ids).logits


def load_moe(path):
    """A converted folder loaded with the Auto classes, checking that every weight was in the files."""
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def folder_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).iterdir()) if p.is_file()}


def assert_same_logits(moe, dense, input_ids, atol: float = 1e-4) -> None:
    torch.testing.assert_close(logits(moe, input_ids), logits(dense, input_ids), atol=atol, rtol=1e-4)


def assert_partition(split, intermediate_size: int):
    """Every neuron in exactly one expert (routed or shared) of an `ExpertSplit`."""
    parts = [split.expert_neurons.flatten()]
    if split.shared_neurons is not None:
        parts.append(split.shared_neurons)
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(intermediate_size))


def calibrated_split(model, input_ids, **fields):
    """The split and k-means centroids a recipe's method computes on `model` (the converter's plan and context)."""
    plan = ConversionPlan.create(MoERecipe.from_dict(fields), model.config)
    context = CalibrationContext(plan.recipe, lambda *_: model, input_ids=input_ids, batch_size=3, progress=False)
    plan.prepare(context)
    method, _ = plan.components["mlp"]
    mlps = {i: model.model.layers[i].mlp for i in plan.targets["mlp"].layers}
    dense = {
        i: {f"{name}.weight": getattr(mlp, name).weight for name in ("gate_proj", "up_proj", "down_proj")}
        for i, mlp in mlps.items()
    }
    return {i: method.split(i, dense[i], context) for i in mlps}, context


class FakeHfApi:
    """Records the calls `push_folder` makes, and the README.md the upload would carry (no Hub access here)."""

    def __init__(self):
        self.calls = []

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))
        return f"https://huggingface.co/{repo_id}"

    def create_commit(self, *, repo_id, operations, **kwargs):
        self.uploaded = {op.path_in_repo: op.path_or_fileobj for op in operations}
        self.uploaded_readme = self.uploaded["README.md"].decode()
        self.calls.append(("create_commit", repo_id, kwargs))
        return "https://huggingface.co/me/tiny-moe/commit/abc"


_REMOTE_LOAD = """
import sys, json, torch
sys.modules["llama_moe_hf"] = sys.modules["llama_moe"] = None  # the package must not be needed
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, dtype=torch.float32).eval()
ids = torch.tensor(json.loads(sys.argv[2]))
with torch.no_grad():
    print(json.dumps({"module": type(model).__module__, "logits": model(ids).logits[0, -1].tolist()}))
"""


def load_as_remote_code(folder: Path, input_ids: torch.Tensor) -> tuple[str, torch.Tensor]:
    """Load a saved folder with `trust_remote_code=True` in a fresh process where this package cannot be imported:
    (the model class's module, the last position's logits of the first row of `input_ids`)."""
    result = subprocess.run(
        [sys.executable, "-c", _REMOTE_LOAD, str(folder), json.dumps(input_ids.tolist())],
        capture_output=True,
        text=True,
        cwd=folder,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    remote = json.loads(result.stdout.strip().splitlines()[-1])
    return remote["module"], torch.tensor(remote["logits"])


RECIPES = Path(__file__).parents[1] / "recipes"


def run_recipe(script: str, argv: list[str]) -> int:
    """Exit status of `recipes/SCRIPT`'s main(argv), run in this process, which must end in SystemExit (an error, or
    --help)."""
    import pytest

    main = runpy.run_path(str(RECIPES / script))["main"]
    with pytest.raises(SystemExit) as exit:
        main(argv)
    return exit.value.code


def one_error_line(capsys) -> str:
    """The one `error: ...` line on stderr (and nothing else there)."""
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    return err.strip()


def last_error_line(capsys) -> str:
    """The `error: ...` line that ends stderr after progress bars of work already done (and no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("error: "), err
    return err.strip().splitlines()[-1]


# Each family with decisive routing, so that a wrong cache changes which experts run, not only the attention.
FAMILY_FIELDS = {
    "llama_moe": dict(method="random", num_experts=4, top_k=2, router_init="random"),
    "attn_moe": dict(
        family="attn_moe", attn_experts=4, attn_top_k=2, attn_router_init="random", mlp_moe=True, num_experts=4, top_k=2
    ),
    "soap_moe": dict(family="soap_moe", num_experts=4, options={"segment_length": 4}),  # segments cross in decoding
}


def tiny_family_model(family: str):
    """A tiny random model of `family` (`FAMILY_FIELDS`) with routers far from uniform, in eval mode."""
    from llama_moe_hf import build_moe

    model = build_moe(tiny_llama(), **FAMILY_FIELDS[family])
    for name, parameter in model.named_parameters():
        if name.endswith("gate.weight"):
            torch.nn.init.normal_(parameter, std=1.0, generator=torch.Generator().manual_seed(len(name)))
    return model.eval()


def run_generation_script(folders: list[Path], prompts: list[list[int]], *flags: str) -> dict[str, dict]:
    """tests/scripts/generation_script.py in a fresh process (`--remote-code`: without the package): per folder, the loaded
    class's module and the greedy continuations of `prompts` in every cache mode."""
    script = Path(__file__).parent / "scripts" / "generation_script.py"
    cmd = [sys.executable, str(script), *flags, json.dumps(prompts), *map(str, folders)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=Path(folders[0]).parent)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def interrupt_the_second_replace(monkeypatch) -> None:
    """`checkpoints.atomic`'s `os.replace` raises KeyboardInterrupt on its second call, after one file was swapped in
    (`monkeypatch.undo()` restores it)."""
    import os

    from llama_moe.checkpoints import atomic

    real_replace, calls = os.replace, []

    def interrupted(source, target):
        calls.append(target)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_replace(source, target)

    monkeypatch.setattr(atomic.os, "replace", interrupted)


def save_with_tokenizer(model, path: Path) -> Path:
    """`model` saved with the character tokenizer; returns `path`."""
    model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def ffn_variant(base, seed: int):
    """`base` with new random FFN weights: a model that shares everything but the FFN with it (a merge's expert)."""
    import copy

    model = copy.deepcopy(base)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model


def export_refusal(argv: list[str], capsys) -> str:
    """`llama-moe export` refusing: exit status 2, one `error:` line, no output folder."""
    from llama_moe.commands import main

    output = argv[argv.index("--output") + 1]
    assert main(["export", *argv, "--no-progress"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and "\n" not in error, error
    assert not Path(output).exists()
    return error


def quick_check_scores(match: float | None = 1.0, kl: float = 0.0, ratio: float = 1.0) -> dict:
    """The numbers `quick_check.QuickCheck` holds, for 24 check prompts (`match` None: no chat template) and 512
    tokens of licence text at a KL of `kl` and `ratio` times the dense perplexity."""
    answers = (
        {}
        if match is None
        else {
            "prompts": 24,
            "answers_match_12": match,
            "answers_whole": match,
            "answer_kl": kl,
            "accuracy": 0.5,
            "dense_accuracy": 0.5,
        }
    )
    text = {"kl": kl, "agreement": 0.9, "perplexity": 20.0 * ratio, "dense_perplexity": 20.0, "tokens": 512}
    return answers | {f"licences_{key}": value for key, value in text.items()}
