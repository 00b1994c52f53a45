"""Hub upload: the real folder goes through `create_repo` + `upload_folder` of a fake client (no Hub access here)."""

import pytest
from helpers import FakeHfApi

from llama_moe_hf import convert_to_moe, push_folder


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_dense):
    out = tmp_path_factory.mktemp("hub") / "moe"
    return convert_to_moe(tiny_dense[0], out, num_experts=4, top_k=2, repo_id="me/tiny-moe", progress=False)


def test_push_with_fake_api_keeps_our_card(converted):
    api = FakeHfApi()
    url = push_folder(converted.output_dir, "me/tiny-moe", private=True, api=api)
    assert url == "https://huggingface.co/me/tiny-moe/commit/abc"
    (create, repo, create_kwargs), (upload, repo2, upload_kwargs) = api.calls
    assert (create, repo, repo2, upload) == ("create_repo", "me/tiny-moe", "me/tiny-moe", "upload_folder")
    assert create_kwargs["exist_ok"] is True and create_kwargs["private"] is True
    assert upload_kwargs["folder_path"] == str(converted.output_dir)
    assert api.uploaded_readme == (converted.output_dir / "README.md").read_text()
    assert "llama-moe" in api.uploaded_readme and 'from_pretrained("me/tiny-moe"' in api.uploaded_readme


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
