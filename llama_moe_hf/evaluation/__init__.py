"""Evaluation (`llama-moe eval`).

perplexity   sliding-window perplexity with exact token accounting, and throughput
harness      lm-evaluation-harness around a model instance; local tasks in tasks/ (run offline)
evaluate     the command's Python API: `evaluate`, `measure`, `EvalOptions`
"""
