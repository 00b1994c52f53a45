"""Calibration data loading, tokenisation, the statistics pass, and the one context per conversion."""

import json

import pytest
import torch
from helpers import tiny_llama
from transformers import AutoTokenizer

from llama_moe.conversion import calibration
from llama_moe.conversion.calibration import CalibrationContext, tokenize_calibration
from llama_moe.conversion.statistics import collect_calibration
from llama_moe.text.documents import iter_documents, load_texts
from llama_moe_hf import MoERecipe

DOCS = ["First document about sorting lists.", "Second one, on parsing dates.", "Third: sockets and select."]


def test_builtin_corpus_is_the_default():
    texts, description = load_texts(None)
    assert len(texts) > 500 and all(text.strip() for text in texts)
    assert description == f"built-in corpus: Python stdlib docstrings ({len(texts)} docs)"


def test_the_mixed_builtin_corpus_holds_three_kinds_from_the_start():
    from llama_moe.text.corpus import LICENCE_PHRASES, package_descriptions, stdlib_code, stdlib_docstrings

    texts, description = load_texts("builtin:mixed")
    assert description.startswith("built-in corpus mixed, three kinds in turn: ")
    assert len(texts) > 500 and all(0 < len(text) <= 2000 for text in texts)
    docstrings, code, readmes = stdlib_docstrings(), stdlib_code(), package_descriptions()
    assert readmes, "every environment that runs this has installed distributions with READMEs"
    assert texts[:3] == [docstrings[0][:2000], code[0][:2000], readmes[0][:2000]]
    assert all(text.startswith(("def ", "class ")) for text in code)  # whole top-level definitions
    assert not any(phrase in text for text in readmes for phrase in LICENCE_PHRASES)
    with pytest.raises(ValueError, match="Unknown built-in corpus 'nope': choose one of docstrings, mixed"):
        load_texts("builtin:nope")


def _write(path, suffix):
    if suffix == ".txt":
        path.write_text(DOCS[0])
    elif suffix == ".json":
        path.write_text(json.dumps({"data": [{"text": d, "id": i} for i, d in enumerate(DOCS)]}))
    elif suffix == ".jsonl":
        path.write_text("\n".join(json.dumps({"content": d, "id": 1}) for d in DOCS) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": DOCS, "n": [1, 2, 3]}), path)


@pytest.mark.parametrize("suffix", [".txt", ".json", ".jsonl", ".parquet"])
def test_local_files_and_folders(tmp_path, suffix):
    file = tmp_path / f"data{suffix}"
    _write(file, suffix)
    texts, description = load_texts(str(file))
    assert texts == (DOCS[:1] if suffix == ".txt" else DOCS)
    assert str(file) in description
    (tmp_path / "ignored.csv").write_text("a,b\n")
    folder_texts, folder_description = load_texts(str(tmp_path))
    assert folder_texts == texts and "1 files" in folder_description


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.txt", "", "holds no text"),
        ("blank.jsonl", "\n\n", "holds no text"),
        ("broken.json", "[{", "is not valid JSON"),
        ("rows.jsonl", '{"a": "x", "b": "y"}\n', "cannot tell which field holds the text"),
        ("data.csv", "a,b", "must end in one of"),
    ],
)
def test_bad_local_files(tmp_path, name, content, message):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        load_texts(str(tmp_path / name))


def test_empty_folder(tmp_path):
    with pytest.raises(ValueError, match="holds no"):
        load_texts(str(tmp_path))


def test_unknown_dataset_gives_a_clear_error(monkeypatch):
    # The real datasets loader with the Hub unreachable (offline mode: no network retries).
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="not a local file or folder, and datasets.load_dataset"):
        load_texts("no-such-org/no-such-dataset")


@pytest.mark.parametrize("spec", ["missing-folder/docs.jsonl", "./notes", "/no/such/corpus"])
def test_a_missing_local_file_is_refused_without_asking_the_hub(spec):
    def hub(*args, **kwargs):
        raise AssertionError("a local path went to the Hub")

    with pytest.raises(ValueError, match=f"Calibration data file {spec} does not exist"):
        load_texts(spec, dataset_loader=hub)
    with pytest.raises(ValueError, match=f"Data file {spec} does not exist"):
        next(iter_documents(spec, dataset_loader=hub))


def test_dataset_names_go_through_the_loader_seam():
    calls = []

    def fake_hub(path, config, split, streaming):
        calls.append((path, config, split, streaming))
        return iter({"text": f"row {i} " * 10, "meta": i} for i in range(1000))

    texts, description = load_texts("org/corpus:en", max_chars=200, dataset_loader=fake_hub)
    assert calls == [("org/corpus", "en", "train", True)]
    assert 2 <= len(texts) <= 4 and texts[0].startswith("row 0")  # streaming stops after max_chars
    assert "'org/corpus:en'" in description


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def test_tokenize_packs_documents_with_eos(tokenizer):
    ids = tokenize_calibration(DOCS * 10, tokenizer, num_tokens=64, seq_len=16)
    assert ids.shape == (4, 16) and ids.dtype == torch.long
    first = tokenizer(DOCS[0], add_special_tokens=False)["input_ids"]
    assert ids.flatten()[: len(first) + 1].tolist() == first + [tokenizer.eos_token_id]
    assert torch.equal(ids, tokenize_calibration(DOCS * 10, tokenizer, num_tokens=64, seq_len=16))


def test_tokenize_rejects_text_shorter_than_a_sequence(tokenizer):
    with pytest.raises(ValueError, match="fewer than one sequence of 512"):
        tokenize_calibration(DOCS, tokenizer, num_tokens=4096, seq_len=512)
    with pytest.raises(ValueError, match="at least one sequence"):
        tokenize_calibration(DOCS, tokenizer, num_tokens=8, seq_len=16)


@pytest.fixture
def tiny_model():
    return tiny_llama()


def _reference_stats(model, input_ids, layer, groups):
    """Independent computation: capture h with retain_grad on one full-batch pass, then average per group."""
    captured = {}

    def keep(module, args):
        captured["h"] = args[0]
        args[0].retain_grad()

    handle = model.model.layers[layer].mlp.down_proj.register_forward_pre_hook(keep)
    embeds = model.model.embed_tokens(input_ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds).logits
    torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten(), reduction="sum"
    ).backward()
    handle.remove()
    h = captured["h"].flatten(0, 1)
    scores = (h * captured["h"].grad.flatten(0, 1)).abs()
    importance = torch.stack([scores[groups == g].mean(0) for g in range(int(groups.max()) + 1)])
    return h.detach().mean(0), importance


def test_statistics_match_autograd_and_ignore_batch_size(tiny_model):
    input_ids = torch.randint(0, 128, (6, 12), generator=torch.Generator().manual_seed(1))
    sequence_groups = torch.tensor([0, 1, 2, 0, 1, 2])
    runs = [
        collect_calibration(
            tiny_model,
            input_ids,
            [0, 1],
            with_gradients=True,
            sequence_groups=sequence_groups,
            num_groups=3,
            max_hidden_samples=30,
            batch_size=batch_size,
            progress=False,
        ).mlp
        for batch_size in (1, 4)
    ]
    # The model is left as it was: no parameter gradients, flags restored.
    assert all(p.grad is None and p.requires_grad for p in tiny_model.parameters())
    mean, importance = _reference_stats(tiny_model, input_ids, 1, sequence_groups.repeat_interleave(12))
    for stats in runs:
        torch.testing.assert_close(stats[1].mean_activation, mean, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(stats[1].importance, importance, atol=1e-7, rtol=1e-4)
        assert stats[1].group_counts.tolist() == [24, 24, 24]
        assert stats[0].hidden_states.shape == (30, 64)
    assert torch.equal(runs[0][0].hidden_states, runs[1][0].hidden_states)  # same sampled positions


def _every_statistic(dense, input_ids, **kwargs):
    def parity(layer, x):
        return (x[:, 0] > 0).long()

    common = dict(max_hidden_samples=30, batch_size=4, progress=False, **kwargs)
    gradients = collect_calibration(
        dense, input_ids, [0, 1], with_gradients=True, token_groups=parity, num_groups=2, **common
    )
    forward = collect_calibration(
        dense, input_ids, [0, 1], attention_experts={1: 2}, sequence_embeddings=True, **common
    )
    return gradients, forward


def test_a_checkpoints_layers_read_one_at_a_time_give_the_loaded_models_statistics(tiny_dense, tmp_path, caplog):
    """From the source's files (a layer read when it runs) or from the loaded model, in memory or with each layer's
    input spilled to a folder (left empty afterwards): the same statistics."""
    from llama_moe.checkpoints import open_source

    folder, _, _ = tiny_dense
    source = open_source(str(folder))
    model = source.load_model(torch.float32, "cpu")
    input_ids = torch.randint(0, 97, (6, 12), generator=torch.Generator().manual_seed(4))
    expected = _every_statistic(model, input_ids)
    spill = tmp_path / "offload"
    spill.mkdir()
    in_memory = _every_statistic(source, input_ids)
    with caplog.at_level("INFO", logger="llama_moe.conversion.statistics"):
        spilled = _every_statistic(source, input_ids, offload_dir=str(spill))
    assert f"inputs (0.0 GB) go to {spill}" in caplog.text
    for got in (in_memory, spilled):
        for want, have in zip(expected, got):
            for layer in want.mlp:
                for name in ("hidden_states", "mean_activation", "importance", "group_counts"):
                    a, b = getattr(want.mlp[layer], name), getattr(have.mlp[layer], name)
                    assert (a is None) == (b is None)
                    if a is not None:
                        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(got[1].sequence_embeddings, expected[1].sequence_embeddings)
        torch.testing.assert_close(got[1].attention[1].gram, expected[1].attention[1].gram)
        torch.testing.assert_close(got[1].attention[1].cross, expected[1].attention[1].cross)
    assert list(spill.iterdir()) == []


def test_token_groups_and_hidden_samples(tiny_model):
    input_ids = torch.randint(0, 128, (3, 8), generator=torch.Generator().manual_seed(2))

    def parity(layer, x):
        return (x[:, 0] > 0).long()

    stats = collect_calibration(
        tiny_model, input_ids, [1], with_gradients=True, token_groups=parity, num_groups=2, max_hidden_samples=100
    ).mlp[1]
    samples = stats.hidden_states  # every token when the sample is larger than the data
    assert samples.shape == (24, 64)
    assert stats.group_counts.tolist() == [int((samples[:, 0] <= 0).sum()), int((samples[:, 0] > 0).sum())]
    without_gradients = collect_calibration(tiny_model, input_ids, [1], max_hidden_samples=100).mlp[1]
    assert without_gradients.importance is None
    torch.testing.assert_close(without_gradients.hidden_states, samples)
    with pytest.raises(ValueError, match="group ids in"):
        collect_calibration(tiny_model, input_ids, [1], with_gradients=True, token_groups=parity, num_groups=1)
    with pytest.raises(ValueError, match="outside 0..1"):
        collect_calibration(tiny_model, input_ids, [2])


def test_one_pass_records_mlp_attention_and_sequence_statistics(tiny_model):
    """What separate passes would record, recorded together in one."""
    input_ids = torch.randint(0, 128, (4, 10), generator=torch.Generator().manual_seed(3))
    together = collect_calibration(
        tiny_model,
        input_ids,
        [0, 1],
        attention_experts={1: 2},
        sequence_embeddings=True,
        max_hidden_samples=40,
        progress=False,
    )
    alone = collect_calibration(tiny_model, input_ids, [0, 1], max_hidden_samples=40, progress=False)
    for i in (0, 1):
        torch.testing.assert_close(together.mlp[i].hidden_states, alone.mlp[i].hidden_states)
        torch.testing.assert_close(together.mlp[i].mean_activation, alone.mlp[i].mean_activation)
    with torch.no_grad():
        final = tiny_model.model(input_ids).last_hidden_state
    torch.testing.assert_close(together.sequence_embeddings, final.mean(dim=1))
    attention = together.attention[1]
    assert attention.count == 40 and attention.gram.shape == (64, 64) and attention.cross.shape == (64, 2)
    torch.testing.assert_close(attention.cross.sum(dim=1), torch.zeros(64, dtype=torch.float64), atol=1e-9, rtol=0)


def test_context_loads_once_runs_one_pass_and_releases(tiny_model, monkeypatch):
    input_ids = torch.randint(0, 128, (4, 10), generator=torch.Generator().manual_seed(3))
    loads, passes = [], []
    collect = calibration.collect_calibration
    monkeypatch.setattr(calibration, "collect_calibration", lambda *a, **k: passes.append(k) or collect(*a, **k))
    context = CalibrationContext(
        MoERecipe(calibration_samples=16),
        lambda dtype, device: loads.append(dtype) or tiny_model,
        input_ids=input_ids,
        progress=False,
    )
    context.collect()
    assert loads == [] and passes == []  # nothing asked: the model is not even loaded
    context.request_mlp([0, 1])
    context.request_attention([1], num_experts=4)
    context.request_sequence_embeddings()
    context.collect()
    assert len(loads) == 1 and len(passes) == 1
    assert context.mlp(0).hidden_states.shape == (16, 64) and context.attention(1, 4).cross.shape == (64, 4)
    assert context.sequence_embeddings().shape == (4, 64) and len(passes) == 1  # results, no new pass
    first = context.importance("all", [1], num_groups=1)
    assert context.importance("all", [1], num_groups=1) is first and len(passes) == 2  # cached
    assert torch.equal(context.kmeans_centroids(0, 2), context.kmeans_centroids(0, 2)) and len(loads) == 1
    assert context.attention(1, 2).cross.shape == (64, 2) and len(passes) == 3  # another expert count: a new pass
    assert context.attention(1, 4).cross.shape == (64, 4)
    context.release()
    assert context.mlp(1).mean_activation.shape == (96,)  # recorded statistics stay
    with pytest.raises(RuntimeError, match="released"):  # a new pass would need the model again
        context.importance("other", [0], num_groups=1)


def test_builtin_chat_is_the_dense_models_own_answers_in_its_chat_format(tmp_path, monkeypatch):
    """`builtin:chat`: calibration prompts answered by the dense model, made before it is released, as much as the
    healing stages will read; no held-out prompt among them."""
    from helpers import CHAT_TEMPLATE, char_tokenizer

    from llama_moe.text.prompts import prompts

    monkeypatch.setenv("LLAMA_MOE_HF_CACHE", str(tmp_path))
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model = tiny_llama().eval()
    recipe = MoERecipe(calibration_data="builtin:chat", calibration_tokens=512, heal_tokens=512, joint_heal_tokens=1024)
    loads = []
    context = CalibrationContext(
        recipe, lambda *_: loads.append(1) or model, lambda: tokenizer, device="cpu", progress=False
    )
    assert context.input_ids.shape == (2, 256)
    context.release()  # makes the heal stages' 1,536 tokens now: the model is gone after this
    assert context.tokens(1536).shape == (6, 256) and loads == [1]
    assert context.data_description.startswith("built-in corpus chat:")
    texts = context._made["chat"].texts(1536)
    calibration = [p.text for p in prompts("calibration")]
    assert all(text.startswith(f"user: {prompt}\nassistant: ") for text, prompt in zip(texts, calibration))
    held_out = {p.text for split in ("check", "choose", "confirm") for p in prompts(split)}
    assert not any(prompt in held_out for prompt, _ in context._made["chat"].pairs)


@pytest.mark.parametrize("data", ["builtin:chat", "builtin:chat-mixed"])
def test_the_text_stages_forecast_counts_the_tokens_the_dense_model_writes(tmp_path, monkeypatch, data):
    """The forecast's text stage (its FLOPs: 2 x the dense parameters a token) counts what the conversion has the dense
    model write: the heals' tokens together, or the calibration's where more; its conversations alone in a mix. The
    made text overshoots it by at most one batch of conversations."""
    from helpers import CHAT_TEMPLATE, char_tokenizer

    from llama_moe.conversion.forecast import _text
    from llama_moe.footprint import parameter_counts
    from llama_moe.text.chat import BATCH

    monkeypatch.setenv("LLAMA_MOE_HF_CACHE", str(tmp_path))
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model = tiny_llama().eval()
    for calibration_tokens, heal_tokens, joint_tokens in ((512, 8192, 8192), (16384, 512, 512)):  # several batches
        fields = dict(calibration_tokens=calibration_tokens, heal_tokens=heal_tokens, joint_heal_tokens=joint_tokens)
        recipe = MoERecipe(calibration_data=data, **fields)
        context = CalibrationContext(recipe, lambda *_: model, lambda: tokenizer, device="cpu", progress=False)
        context.release()
        made = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in context._made["chat"].texts(0)]
        counts = parameter_counts(model.config)
        forecast = _text(counts, recipe, calibration.text_tokens(recipe)).flops / (2 * counts.total)
        assert sum(made[:-BATCH]) < forecast <= sum(made)


def test_builtin_chat_answers_are_cached_per_model(tmp_path, monkeypatch):
    """A second conversion of the same model reads the answers made by the first and answers only what is new; a model
    with other weights answers everything again."""
    from helpers import CHAT_TEMPLATE, char_tokenizer

    from llama_moe.text.chat import SelfDistilledChats

    monkeypatch.setenv("LLAMA_MOE_HF_CACHE", str(tmp_path))
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model = tiny_llama().eval()
    generated = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: generated.append(len(kw["input_ids"])) or generate(**kw))

    def chats(m, num_tokens):
        context = CalibrationContext(
            MoERecipe(calibration_data="builtin:chat", calibration_tokens=num_tokens),
            lambda *_: m,
            lambda: tokenizer,
            device="cpu",
            progress=False,
        )
        assert context.input_ids.shape[1] == 256  # made the conversations
        return context._made["chat"]

    first = chats(model, 512)
    made = len(generated)
    assert made and list(tmp_path.glob("chat/*.jsonl"))
    second = chats(model, 512)
    assert len(generated) == made and second.pairs == first.pairs[: len(second.pairs)]  # read back, none answered
    cached = SelfDistilledChats(model, tokenizer, cache=tmp_path / "chat")
    all_cached = sum(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in first._texts)
    cached.texts(all_cached + 1)  # one conversation past the cached ones: one batch answered
    assert cached.pairs[: len(first.pairs)] == first.pairs and len(generated) == made + 1
    other = tiny_llama(seed=1).eval()
    assert SelfDistilledChats(other, tokenizer, cache=tmp_path / "chat")._cached == []


def test_builtin_chat_without_a_chat_template_falls_back_to_the_mixed_corpus(caplog):
    from helpers import char_tokenizer

    recipe = MoERecipe(calibration_data="builtin:chat", calibration_tokens=512)
    context = CalibrationContext(recipe, lambda *_: tiny_llama(), char_tokenizer, device="cpu", progress=False)
    with caplog.at_level("WARNING"):
        assert context.input_ids.shape == (2, 256)
    assert "no chat template" in caplog.text and context.data_description.startswith("built-in corpus mixed")


@pytest.mark.parametrize("data", ["builtin:self", "builtin:chat-self"])
def test_builtin_self_is_text_the_dense_model_samples_and_the_same_each_time(tmp_path, monkeypatch, data):
    """`builtin:self`: texts the dense model writes from its start token (seeded: the same model writes the same
    texts, read back from the cache or made again); `builtin:chat-self`: a conversation and a sampled text in turn."""
    from helpers import CHAT_TEMPLATE, char_tokenizer

    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    model = tiny_llama().eval()

    def context_ids(cache):
        monkeypatch.setenv("LLAMA_MOE_HF_CACHE", str(cache))
        recipe = MoERecipe(calibration_data=data, calibration_tokens=1024)
        context = CalibrationContext(recipe, lambda *_: model, lambda: tokenizer, device="cpu", progress=False)
        return context.input_ids, context

    ids, context = context_ids(tmp_path / "a")
    assert ids.shape == (4, 256)
    assert torch.equal(context_ids(tmp_path / "a")[0], ids) and torch.equal(context_ids(tmp_path / "b")[0], ids)
    sampled = context._made["self"]._texts
    assert len(set(sampled)) == len(sampled) > 1 and not any(text.startswith("user: ") for text in sampled)
    if data == "builtin:chat-self":
        texts = context._self_made_texts(1024)[0]
        assert texts[0].startswith("user: ") and texts[1] == sampled[0] and texts[2].startswith("user: ")
