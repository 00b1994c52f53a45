"""Hub upload: the real folder goes through `create_repo` + `create_commit` of a fake client (no Hub access here)."""

import json
import shutil

import pytest
from helpers import FakeHfApi
from huggingface_hub import ModelCard

from llama_moe.hub.card import card_for_repo, eval_results
from llama_moe.hub.push import plan_push
from llama_moe_hf import convert_to_moe, push_folder

EVAL_RESULTS = {
    "dtype": "float32",
    "parameters": {"total": 1000, "active": 600},
    "perplexity": {
        "wiki": {"perplexity": 12.345678, "tokens": 100, "source": "wikitext:raw", "dataset": "wikitext:raw"},
        "test.jsonl": {"perplexity": 20.0, "tokens": 50, "source": "/data/test.jsonl", "dataset": None},
    },
    "window": 64,
    "stride": 32,
    "lm_eval": {"llama_moe_arithmetic": {"acc": 0.31, "acc_stderr": 0.04}, "hellaswag": {"acc_norm": 0.28}},
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_dense):
    out = tmp_path_factory.mktemp("hub") / "moe"
    return convert_to_moe(tiny_dense[0], out, num_experts=4, top_k=2, repo_id="me/tiny-moe", progress=False)


def test_push_with_fake_api_keeps_our_card(converted):
    api = FakeHfApi()
    url = push_folder(converted.output_dir, "me/tiny-moe", private=True, api=api)
    assert url == "https://huggingface.co/me/tiny-moe/commit/abc"
    (create, repo, create_kwargs), (commit, repo2, _) = api.calls
    assert (create, repo, repo2, commit) == ("create_repo", "me/tiny-moe", "me/tiny-moe", "create_commit")
    assert create_kwargs["exist_ok"] is True and create_kwargs["private"] is True
    files = {p.name for p in converted.output_dir.iterdir()}
    assert set(api.uploaded) == files
    assert api.uploaded["model.safetensors"] == str(converted.output_dir / "model.safetensors")
    assert api.uploaded_readme == plan_push(converted.output_dir, "me/tiny-moe").card
    assert "llama-moe" in api.uploaded_readme and 'from_pretrained("me/tiny-moe"' in api.uploaded_readme


def test_pushed_card_names_the_repository_and_carries_eval_results_and_routing_plots(converted, tmp_path):
    folder = tmp_path / "moe"
    shutil.copytree(converted.output_dir, folder)
    (folder / "eval_results.json").write_text(json.dumps(EVAL_RESULTS))
    (folder / "analysis").mkdir()
    (folder / "analysis" / "routing_mlp.png").write_bytes(b"png")
    readme = (folder / "README.md").read_text()
    api = FakeHfApi()
    push_folder(folder, "someone/else", api=api)
    card = ModelCard(api.uploaded_readme)
    assert 'from_pretrained("someone/else"' in card.text and 'from_pretrained("me/tiny-moe"' not in card.text
    assert str(folder) not in card.text and str(converted.output_dir) not in card.text
    results = {(r.dataset_type, r.dataset_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    # only Hub datasets: the local file and this package's local task are in the Evaluation table only
    assert results == {("wikitext", "wiki", "perplexity"): 12.3457, ("hellaswag", "hellaswag", "acc_norm"): 0.28}
    assert card.data.eval_results[0].dataset_config == "raw"
    metadata = api.uploaded_readme.split("\n---\n", 1)[0]
    assert "test.jsonl" not in metadata and "llama_moe_arithmetic" not in metadata
    assert "| perplexity (test.jsonl) | 20.000 |" in card.text and "| llama_moe_arithmetic acc | 0.3100 |" in card.text
    assert card.data.model_name == "else" and card.text.lstrip().startswith("# else\n")
    assert "## Evaluation" in card.text and "| perplexity (wiki) | 12.346 |" in card.text
    assert "![routing_mlp](analysis/routing_mlp.png)" in card.text
    assert set(api.uploaded) >= {"eval_results.json", "analysis/routing_mlp.png"}
    assert (folder / "README.md").read_text() == readme  # the local card is not touched
    again = card_for_repo(api.uploaded_readme, folder, "someone/else")  # a card pushed twice: sections replaced
    assert again.count("## Evaluation") == 1 and again.count("## Routing") == 1 and again.count("## Usage") == 1


def test_results_written_before_eval_named_datasets_are_read_from_their_source():
    old = {  # no `dataset` key: a local path or text file is no dataset, a datasets name (and config) is
        "a.jsonl": {"perplexity": 3.0, "source": "data/a.jsonl"},
        "b": {"perplexity": 3.0, "source": "/abs/b"},
        "corpus": {"perplexity": 3.0, "source": "built-in corpus"},
        "wiki": {"perplexity": 3.0, "source": "wikitext:raw-v1"},
    }
    (result,) = eval_results({"perplexity": old})
    assert (result.dataset_type, result.dataset_config, result.dataset_name) == ("wikitext", "raw-v1", "wiki")


def test_results_on_local_text_only_make_no_model_index(converted, tmp_path):
    folder = tmp_path / "moe"
    shutil.copytree(converted.output_dir, folder)
    local = {**EVAL_RESULTS, "perplexity": {"test.jsonl": EVAL_RESULTS["perplexity"]["test.jsonl"]}, "lm_eval": {}}
    (folder / "eval_results.json").write_text(json.dumps(local))
    card = card_for_repo((folder / "README.md").read_text(), folder, "me/tiny-moe")
    assert "model-index" not in card and "| perplexity (test.jsonl) | 20.000 |" in card


def test_dry_run_lists_files_and_card_without_contacting_anything(converted):
    api = FakeHfApi()
    plan = push_folder(converted.output_dir, "me/tiny-moe", dry_run=True, api=api)
    assert api.calls == []
    names = dict(plan.files)
    assert {"config.json", "README.md", "model.safetensors", "modeling_llama_moe.py", "moe_recipe.yaml"} <= set(names)
    assert names["model.safetensors"] == (converted.output_dir / "model.safetensors").stat().st_size
    text = plan.describe()
    assert "me/tiny-moe (public)" in text and f"{names['model.safetensors']:,}" in text
    assert plan.card in text


def test_push_refuses_bad_folders(tmp_path, converted):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        push_folder(tmp_path / "missing", "me/x", api=FakeHfApi())
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        push_folder(tmp_path / "empty", "me/x", api=FakeHfApi())
    with pytest.raises(ValueError, match="must look like 'org/name'"):
        push_folder(converted.output_dir, "no-namespace", api=FakeHfApi())
