"""Document embedders, registered by name: texts -> L2-normalised float32 embeddings [n, d].

tfidf                  TF-IDF + truncated SVD (scikit-learn): offline, no model download (the default)
sentence-transformers  any sentence-transformers model (`--encoder`)
transformers           any transformers encoder (`--encoder`), mean-pooled over its tokens
"""

import numpy as np

from ..conversion.registry import Registry
from ..preflight import require

EMBEDDERS = Registry("embedder", "embedders")


def _normalised(vectors) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float32)
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def _with_pad_token(tokenizer):
    """Decoder tokenizers have no pad token: any token pads, as the mean pooling masks it out."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


@EMBEDDERS.register("tfidf")
class TfidfEmbedder:
    description = "TF-IDF + truncated SVD (scikit-learn): offline, no model to download"

    def __init__(self, options):
        self.options = options

    def embed(self, texts: list[str]) -> np.ndarray:
        from sklearn.decomposition import TruncatedSVD
        from sklearn.feature_extraction.text import TfidfVectorizer

        tfidf = TfidfVectorizer(sublinear_tf=True, max_features=1 << 18, dtype=np.float32).fit_transform(texts)
        dim = min(self.options.embedding_dim, tfidf.shape[1] - 1, len(texts) - 1)
        if dim < 1:
            return _normalised(tfidf.toarray())
        svd = TruncatedSVD(n_components=dim, algorithm="randomized", random_state=self.options.seed)
        return _normalised(svd.fit_transform(tfidf))


class EncoderEmbedder:
    """An embedder that runs a model named by `--encoder`."""

    def __init__(self, options):
        if not options.encoder:
            raise ValueError(f"--embedder {self.name} needs --encoder MODEL.")
        self.options = options


@EMBEDDERS.register("sentence-transformers")
class SentenceTransformersEmbedder(EncoderEmbedder):
    description = "a sentence-transformers model (--encoder)"

    def __init__(self, options):
        super().__init__(options)
        require("sentence_transformers", "--embedder sentence-transformers")  # before the documents are read

    def embed(self, texts: list[str]) -> np.ndarray:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(self.options.encoder, trust_remote_code=self.options.trust_remote_code)
        _with_pad_token(model.tokenizer)
        vectors = model.encode(
            texts, batch_size=self.options.encoder_batch_size, show_progress_bar=self.options.progress
        )
        return _normalised(vectors)


@EMBEDDERS.register("transformers")
class TransformersEmbedder(EncoderEmbedder):
    description = "a transformers encoder (--encoder), mean-pooled over its tokens"

    def embed(self, texts: list[str]) -> np.ndarray:
        import torch
        from tqdm.auto import tqdm
        from transformers import AutoModel, AutoTokenizer

        trust = self.options.trust_remote_code
        tokenizer = _with_pad_token(AutoTokenizer.from_pretrained(self.options.encoder, trust_remote_code=trust))
        model = AutoModel.from_pretrained(self.options.encoder, trust_remote_code=trust).eval()
        size, batches = self.options.encoder_batch_size, []
        for start in tqdm(range(0, len(texts), size), desc="Embedding", disable=not self.options.progress):
            batch = tokenizer(texts[start : start + size], padding=True, truncation=True, return_tensors="pt")
            with torch.no_grad():
                states = model(**batch).last_hidden_state  # [b, t, d]
            mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
            batches.append(((states * mask).sum(1) / mask.sum(1).clamp(min=1)).float().numpy())
        return _normalised(np.concatenate(batches))
