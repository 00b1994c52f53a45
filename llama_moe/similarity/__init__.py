"""Similarity-based document batching (in-context pre-training, as SOAP trains on): documents that are alike end up
next to each other in the packed training sequences.

    documents -> embed (embedders.py: EMBEDDERS) -> nearest neighbours (neighbours.py: faiss or scikit-learn)
              -> greedy chain (chaining.py) -> tokenize and pack (`text.tokens`) -> datasets folder or JSON lines

`pipeline.batch_similar(options)` runs it all; `llama-moe batch-similar` is its command line.
"""
