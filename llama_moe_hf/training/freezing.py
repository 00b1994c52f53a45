"""Which parameters a training run updates: all of them (the default), all but the routers, or only the MoE blocks
the conversion built."""

# The families' converted modules: LlamaMoE's and AttnMoE's MLP blocks, SoapMoE's block, AttnMoE's attention experts.
MOE_MODULE_SUFFIXES = ("SparseMoeBlock", "MoEBlock", "MoEAttention")


def freeze_routers(model) -> int:
    """Stop training the routers (every module whose class name ends in "Router"); returns the parameters frozen."""
    frozen = 0
    for module in model.modules():
        if type(module).__name__.endswith("Router"):
            for parameter in module.parameters():
                parameter.requires_grad_(False)
                frozen += parameter.numel()
    if not frozen:
        raise ValueError(f"freeze_routers: {type(model).__name__} has no router modules.")
    return frozen


def train_moe_only(model) -> int:
    """Train only the MoE blocks (experts, shared experts, routers, compensation; AttnMoE's attention experts): the
    embeddings, the norms, the LM head and the layers left dense keep the source model's weights, which the
    conversion copied unchanged. Returns the number of parameters left to train."""
    blocks = [module for module in model.modules() if type(module).__name__.endswith(MOE_MODULE_SUFFIXES)]
    if not blocks:
        raise ValueError(f"train_moe_only: {type(model).__name__} has no MoE blocks.")
    model.requires_grad_(False)
    for block in blocks:
        block.requires_grad_(True)
    return sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
