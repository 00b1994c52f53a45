"""The behaviour measurements: held-out prompt splits that never meet the calibration prompts, answer agreement and
KL against the dense model, and the conversion's quick check that tells the truth about both."""

import copy

import pytest
import torch
from helpers import quick_check_scores

from llama_moe import behaviour
from llama_moe.conversion.quick_check import QuickCheck, held_out_rows, licence_texts
from llama_moe.text.prompts import CHECK_PER_KIND, SPLITS, Prompt, prompts


def test_prompt_splits_are_disjoint_in_what_they_ask_and_deterministic():
    splits = {name: prompts(name) for name in SPLITS}
    groups = {name: {p.group for p in ps} for name, ps in splits.items()}
    for a in SPLITS:
        for b in SPLITS:
            if a < b:
                assert not groups[a] & groups[b], (a, b)  # no country, sum or story is asked in two splits
    assert [p.text for p in prompts("confirm")] == [p.text for p in splits["confirm"]]
    kinds = {p.kind for p in splits["check"]}
    assert len(splits["check"]) == CHECK_PER_KIND * len(kinds) and len(kinds) >= 6
    for held in ("choose", "confirm"):
        assert len(splits[held]) >= 200 and kinds <= {p.kind for p in splits[held]}
    assert len(splits["calibration"]) > 2000


@pytest.mark.parametrize(
    ("answer", "reply", "right"),
    [
        ("12", "The answer is 12.", True),
        ("12", "112", False),
        ("1200", "1,200", True),
        ("Paris", "The capital of France is paris.", True),
        ("Paris", "It is Lyon.", False),
        (None, "anything", None),
    ],
)
def test_a_checkable_answer_is_found_in_the_reply(answer, reply, right):
    assert Prompt("facts", "q", "g", answer).correct(reply) is right


@pytest.fixture(scope="module")
def reference(smollm2):
    model, tokenizer = smollm2
    rows = held_out_rows(tokenizer, 256, 128)
    return behaviour.dense_reference(model, tokenizer, prompts("check")[:8], {"licences": rows}, max_new_tokens=12)


def test_the_dense_model_against_itself_agrees_everywhere(smollm2, reference):
    numbers = behaviour.score(smollm2[0], reference, max_new_tokens=12).as_dict()
    assert numbers["answers_match_12"] == numbers["answers_whole"] == numbers["answer_prefix"] == 1.0
    assert abs(numbers["answer_kl"]) < 1e-3 and abs(numbers["licences_kl"]) < 1e-3
    assert numbers["licences_agreement"] == 1.0
    assert numbers["licences_perplexity"] == pytest.approx(numbers["licences_dense_perplexity"], rel=1e-3)


def test_a_damaged_model_is_seen_in_its_answers_and_its_kl(smollm2, reference):
    damaged = copy.deepcopy(smollm2[0])
    with torch.no_grad():
        for layer in damaged.model.layers[:10]:
            layer.mlp.down_proj.weight.zero_()  # a third of the FFNs gone
    numbers = behaviour.score(damaged, reference, max_new_tokens=12).as_dict()
    assert numbers["answers_match_12"] < 0.5
    assert numbers["answer_kl"] > 0.1 and numbers["licences_kl"] > 0.1
    assert numbers["licences_agreement"] < 0.9


def test_batched_answers_are_the_answers_alone(smollm2, reference):
    model, _ = smollm2
    alone = [behaviour.greedy_answers(model, [ids], reference.eos, 12)[0] for ids in reference.prompt_ids[:3]]
    for a, b in zip(alone, reference.answers[:3]):
        assert torch.equal(a, b)


def _check(match, kl, ratio=1.0, float32_match=None) -> QuickCheck:
    changed = None if float32_match is None else round(24 * abs(float32_match - match))
    return QuickCheck(quick_check_scores(match, kl, ratio), "bfloat16", changed, float32_match)


def test_the_check_calls_a_model_as_good_as_dense_only_within_noise():
    assert "as good as the dense model" in _check(1.0, 0.002).verdict()
    # the sparse-50: perplexity near dense's on one text, but no answer kept
    assert "below the dense model" in _check(0.0, 0.002, ratio=0.95).verdict()
    assert "below the dense model" in _check(1.0, 0.3).verdict()
    assert "needs training" in _check(0.0, 3.0, ratio=50).verdict()
    # bfloat16 arithmetic moves close calls: an exact upcycle in bfloat16 keeps 20 of 24, its float32 twin all
    rounded = _check(20 / 24, 0.002, float32_match=1.0)
    assert "as good as the dense model" in rounded.verdict() and "4 of 24 answers differ" in rounded.describe()
    text = _check(0.5, 0.3).describe()
    assert "12 of 24 begin as the dense model's" in text and "licence texts" in text


def test_the_check_text_is_no_calibration_corpus(real_text):
    texts = licence_texts()
    assert len("".join(texts)) > 10_000  # torch, transformers and their dependencies carry licences
    assert not set(texts) & set(real_text)
