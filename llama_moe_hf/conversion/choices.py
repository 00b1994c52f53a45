"""Names that both the command line (light, no torch) and the algorithms (torch) use: kept here for both to import."""

CLUSTER_ON = ("gate", "up", "both", "activations")  # what --method cluster clusters
SELECTOR_OBJECTIVES = ("listwise", "bce")  # the selector router's training loss
# The gates of llama_moe_hf.modeling (`ROUTER_CLASSES`): the modeling files are remote code and cannot be imported
# without torch, so the command line keeps the names here (tests/test_modeling.py checks that they agree), like the
# attention expert granularities of configuration_attn_moe.
ROUTER_TYPES = ("top_k", "switch", "noisy_top_k", "selector", "expert_choice", "analytical")
ATTENTION_GRANULARITIES = ("kv_group", "query_heads")
