"""Text, the one path from documents to token blocks that calibration, training, evaluation, analysis and
similarity batching share:

    documents.py   where documents come from: local files and folders, `datasets` names, the built-in corpus
    corpus.py      the built-in corpora (Python standard-library docstrings: real English; builtin:mixed)
    tokens.py      documents -> EOS-joined token stream -> fixed blocks (streamed, packed, or in a given order)

Importing this package imports nothing; `tokens` imports torch, `documents` nothing heavy.
"""
