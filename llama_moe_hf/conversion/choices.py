"""Names that both the command line (light, no torch) and the algorithms (torch) use, kept here for both to import.

The model code's own names (its gates, attention expert granularities, SoapMoE routing modes) are read from the
modeling files' source, not copied: those files are remote code that imports transformers (and torch), which the
command line must not import to answer `--help`.
"""

import ast
from pathlib import Path

CLUSTER_ON = ("gate", "up", "both", "activations")  # what --method cluster clusters
SELECTOR_OBJECTIVES = ("listwise", "bce")  # the selector router's training loss
HEAL_SCHEDULES = ("constant", "cosine", "linear")  # healing's learning rate over each layer's steps
HEAL_TARGETS = ("stream", "mlp")  # what healing trains each MoE MLP to reproduce


def _model_constant(file: str, name: str) -> tuple[str, ...]:
    """The literal tuple `name = (...)` of `llama_moe_hf/modeling/<file>`, read without importing it."""
    tree = ast.parse((Path(__file__).parents[1] / "modeling" / file).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise LookupError(f"modeling/{file} defines no {name}")


ROUTER_TYPES = _model_constant("configuration_llama_moe.py", "ROUTER_TYPES")
ATTENTION_GRANULARITIES = _model_constant("configuration_attn_moe.py", "ATTENTION_EXPERT_GRANULARITIES")
ROUTING_MODES = _model_constant("configuration_soap_moe.py", "ROUTING_MODES")
