"""Routing analysis of MoE models (`llama-moe analyze`).

probes/       how each kind of routed block is read (MoE MLP, attention experts, SOAP): one module each
statistics    running sums per site and domain (memory independent of the data size)
report        the numbers: load, balance, entropy, capacity drops, domain distances, expert similarity
plots         PNG heatmap grids (matplotlib)
summary       summary.md
analyze       the command's Python API: `analyze`, `analyze_model`, `AnalyzeOptions`
"""
