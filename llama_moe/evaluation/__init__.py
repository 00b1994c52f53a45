"""Evaluation (`llama-moe eval`).

harness      lm-evaluation-harness around a model instance; local tasks in tasks/ (run offline)
evaluate     the command's Python API: `evaluate`, `measure`, `EvalOptions` (perplexity: `llama_moe.perplexity`)
"""
