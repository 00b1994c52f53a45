"""The merge's router inits (mergekit-moe's gate modes and ours): the layer-wise hidden states equal transformers' own
of the whole model; `hidden` and `cheap_embed` rows are mergekit's formulas, computed here from the whole model;
`uniform_random` is torch.nn.Linear's init, seeded per layer; `expert_data` reads each expert's own text; missing
prompts or data are one line, exit status 2 and nothing written."""

import math

import pytest
import torch
from helpers import FAMILY_CONFIGS, SOURCE_FIELDS, char_tokenizer, last_error_line, one_error_line, tiny_llama_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from llama_moe.checkpoints import open_source
from llama_moe.commands import main
from llama_moe.conversion.layerwise import layer_input_states
from llama_moe.conversion.plan import ConversionPlan
from llama_moe.conversion.settings import RunOptions
from llama_moe.conversion.target import ROUTER_STREAM, layer_seed
from llama_moe.merging.config import ExpertSource, MergeConfig
from llama_moe.merging.pipeline import merge
from llama_moe_hf import MoERecipe

LAYERS = 3  # qwen3's tiny model: layer 1 slides (window 5), and its output is layer 2's input
CODE = "def double(x):\n    return x * 2\n" * 12
PROSE = "The quick brown fox jumps over the lazy dog. " * 8


def three_layer_source(family: str, seed: int):
    """helpers' tiny model of `family` (norms and biases random too) with three decoder layers."""
    config_class, fields = FAMILY_CONFIGS[family]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_class(**(SOURCE_FIELDS | fields | {"num_hidden_layers": LAYERS})))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.3 * torch.randn_like(param))
    return model.eval()


def save(model, path, tokenizer=None):
    model.save_pretrained(path)
    (tokenizer or char_tokenizer()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(root, base model, base folder, three expert folders): the experts are copies of the base (the gates read only
    the base), and the base's tokenizer has a BOS."""
    root = tmp_path_factory.mktemp("gates")
    model = three_layer_source("llama", seed=0)
    tokenizer = char_tokenizer()
    tokenizer.bos_token = "</s>"
    base = save(model, root / "base", tokenizer)
    return root, model, base, [save(model, root / f"expert{i}") for i in range(3)]


def merged_gates(root, base, experts: list[ExpertSource], name: str, **fields) -> list[torch.Tensor]:
    config = MergeConfig(experts=tuple(experts), base_model=str(base), experts_per_token=1, **fields)
    output = merge(config, RunOptions(output=str(root / name), progress=False, eval=False)).output_dir
    tensors = {k: v for shard in output.glob("*.safetensors") for k, v in load_file(shard).items()}
    return [tensors[f"model.layers.{i}.mlp.gate.weight"].float() for i in range(LAYERS)]


def whole_model_states(model, ids: list[int]) -> torch.Tensor:
    """`[L, S, H]`: transformers' `hidden_states` at each decoder layer's input (the last entry is after the norm)."""
    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.stack(states[:-1])[:, 0]


def unit(vector: torch.Tensor) -> torch.Tensor:
    return vector / vector.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_layerwise_states_are_the_whole_models(family, tmp_path):
    model = three_layer_source(family, seed=1)
    source = open_source(str(save(model, tmp_path / family)))
    generator = torch.Generator().manual_seed(0)
    token_lists = [torch.randint(2, 100, (n,), generator=generator).tolist() for n in (1, 7, 12, 7)]  # two of 7 batch
    reduced = {reduce: layer_input_states(source, token_lists, reduce) for reduce in ("last", "mean", "sum")}
    for index, ids in enumerate(token_lists):
        states = whole_model_states(model, ids)
        torch.testing.assert_close(reduced["last"][:, index], states[:, -1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(reduced["mean"][:, index], states.mean(dim=1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(reduced["sum"][:, index], states.sum(dim=1), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("hidden_token", ["last", "mean"])
def test_hidden_rows_are_mergekits_vectors(hidden_token, llama):
    """Row i, layer l: mean over expert i's positive prompts of the base's layer-l input (at the prompt's last token,
    or the mean over its tokens) minus the same over its negative prompts, normalised; the tokens have the BOS."""
    root, model, base, folders = llama
    prompts = [(["def add(a, b):", "import os"], ["Once upon a time"]), (["The cat sat."], []), (["SELECT 1;"], [])]
    experts = [ExpertSource(str(f), tuple(p), tuple(n)) for f, (p, n) in zip(folders, prompts, strict=True)]
    gates = merged_gates(root, base, experts, f"hidden-{hidden_token}", gate_mode="hidden", hidden_token=hidden_token)

    def mean_state(texts):
        states = [whole_model_states(model, [1, *char_tokenizer()(t)["input_ids"]]) for t in texts]
        return torch.stack([s[:, -1] if hidden_token == "last" else s.mean(dim=1) for s in states]).mean(dim=0)

    for i, (positive, negative) in enumerate(prompts):
        expected = unit(mean_state(positive) - (mean_state(negative) if negative else 0))
        for layer in range(LAYERS):
            torch.testing.assert_close(gates[layer][i], expected[layer], atol=1e-5, rtol=1e-5)


def test_a_single_prompts_own_state_routes_to_its_expert(llama):
    """Sound whatever the weights (Cauchy-Schwarz): the state a one-prompt expert's unit row was made from has its
    largest product with that row. The router itself sees the post-attention state, so no routing claim is made."""
    root, model, base, folders = llama
    prompts = ["def add(a, b):", "The cat sat on the mat.", "SELECT * FROM t;"]
    experts = [ExpertSource(str(f), (p,)) for f, p in zip(folders, prompts, strict=True)]
    gates = merged_gates(root, base, experts, "routes", gate_mode="hidden")
    for i, prompt in enumerate(prompts):
        states = whole_model_states(model, [1, *char_tokenizer()(prompt)["input_ids"]])[:, -1]
        for layer in range(LAYERS):
            assert (gates[layer] @ states[layer]).argmax() == i


def test_cheap_embed_is_the_normalised_prompt_embeddings(llama):
    """mergekit: unit(unit(sum of the positive prompts' embeddings) - unit(sum of the negative ones')), every layer,
    on each model's consecutive rows (two experts per model here)."""
    root, model, base, folders = llama
    prompts = [(["def add(a, b):", "import os"], ["Once upon a time"]), (["The cat sat."], [])]
    experts = [ExpertSource(str(f), tuple(p), tuple(n)) for f, (p, n) in zip(folders[:2], prompts, strict=True)]
    gates = merged_gates(
        root, base, experts, "cheap", gate_mode="cheap_embed", method="sequential", experts_per_model=2
    )
    embed = model.model.embed_tokens.weight.detach()

    def embedded(texts):
        ids = [i for t in texts for i in [1, *char_tokenizer()(t)["input_ids"]]]
        return unit(embed[ids].sum(dim=0))

    for i, (positive, negative) in enumerate(prompts):
        expected = unit(embedded(positive) - (embedded(negative) if negative else 0))
        for layer in range(LAYERS):
            torch.testing.assert_close(gates[layer][2 * i : 2 * i + 2], expected.expand(2, -1), atol=1e-6, rtol=1e-5)


def test_uniform_random_is_linears_init_seeded_per_layer():
    def weights(seed: int, layer: int) -> torch.Tensor:
        recipe = MoERecipe.from_dict({"num_experts": 4, "top_k": 2, "router_init": "uniform_random", "seed": seed})
        _, router = ConversionPlan.create(recipe, tiny_llama_config()).components["mlp"]
        return router.tensors(layer, None, None)["weight"]

    bound = 1 / math.sqrt(tiny_llama_config().hidden_size)
    weight = weights(3, 1)
    generator = torch.Generator().manual_seed(layer_seed(3, 1, ROUTER_STREAM))
    torch.testing.assert_close(weight, torch.empty(4, 64).uniform_(-bound, bound, generator=generator))
    assert weight.abs().max() <= bound and weight.abs().max() > 0.9 * bound
    assert torch.equal(weight, weights(3, 1))
    assert not torch.equal(weight, weights(3, 0)) and not torch.equal(weight, weights(4, 1))


@pytest.mark.parametrize("center", [True, False])
def test_expert_data_rows_are_the_mean_states_of_each_experts_text(llama, center):
    """Row i: the base's layer input averaged over the first gate_tokens tokens of expert i's text (EOS after each
    document), in sequences of at most the model's 128 positions, minus the mean over the experts (by default),
    normalised."""
    root, model, base, folders = llama
    texts = [CODE, PROSE]
    for i, text in enumerate(texts):
        (root / f"data{i}.txt").write_text(text)
    experts = [ExpertSource(str(folders[i]), data=str(root / f"data{i}.txt")) for i in range(2)]
    options = {} if center else {"expert_data_center": False}
    gates = merged_gates(
        root, base, experts, f"data-{center}", gate_mode="expert_data", gate_tokens=300, gate_options=options
    )
    means = []
    for text in texts:
        ids = (char_tokenizer()(text)["input_ids"] + [1])[:300]
        states = torch.cat(
            [whole_model_states(model, ids[start : start + 128]) for start in range(0, len(ids), 128)], 1
        )
        means.append(states.mean(dim=1))
    means = torch.stack(means, dim=1)  # [L, experts, H]
    expected = unit(means - means.mean(dim=1, keepdim=True) if center else means)
    for layer in range(LAYERS):
        torch.testing.assert_close(gates[layer], expected[layer], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(gates[0][0], gates[0][1], atol=0.1)


@pytest.mark.parametrize(
    ("gate_mode", "expert1", "message"),
    [
        ("hidden", "", "has no positive_prompts"),
        ("cheap_embed", "    negative_prompts: [x]\n", "has no positive_prompts"),
        ("expert_data", "", "has no data"),
        ("expert_data", "    data: {root}/missing.txt\n", "missing.txt does not exist"),
    ],
)
def test_missing_prompts_or_data_are_one_line_and_nothing_is_written(gate_mode, expert1, message, llama, capsys):
    root, _, base, folders = llama
    (root / "data0.txt").write_text(PROSE)
    expert0 = f"    positive_prompts: [hello]\n    data: {root}/data0.txt\n"
    text = f"base_model: {base}\ngate_mode: {gate_mode}\nexperts:\n"
    text += f"  - source_model: {folders[0]}\n{expert0}  - source_model: {folders[1]}\n{expert1.format(root=root)}"
    (root / "m.yaml").write_text(text)
    out = root / "refused"
    capsys.readouterr()
    assert main(["merge", "--config", str(root / "m.yaml"), "--output", str(out), "--no-progress"]) == 2
    line = last_error_line(capsys)  # after the merge's own log lines
    assert message in line and str(folders[1]) in line
    assert not out.exists() and not list(root.glob(".refused*"))


def test_convert_refuses_a_merges_router_init(llama, capsys):
    root, _, base, _ = llama
    out = root / "converted"
    argv = ["convert", "--model", str(base), "--output", str(out), "--router-init", "hidden", "--no-progress"]
    capsys.readouterr()
    assert main([*argv, "--num-experts", "4", "--top-k", "2"]) == 2
    assert "use it with `llama-moe merge`" in one_error_line(capsys)
    assert not out.exists()


def test_identical_prompts_are_warned_of(llama, caplog):
    """mergekit's `warn_degenerate_gates`: two experts with the same prompts get the same row in every layer."""
    root, _, base, folders = llama
    experts = [ExpertSource(str(f), ("def add(a, b):",)) for f in folders[:2]]
    merged_gates(root, base, experts, "same", gate_mode="cheap_embed")
    assert "nearly linearly dependent in every layer" in caplog.text
