"""Which parameters a training run updates: all of them (the default), all but the routers, only the MoE blocks
the conversion built, or only the MLP routers (a router-only MiX stage)."""

ROUTER_PARAMETER = "mlp.gate."  # the MLP routers' parameters: `model.layers.N.mlp.gate.weight`, ...

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


def train_routers_only(model) -> int:
    """Train only the MLP routers (`mlp.gate.*`), every other weight frozen: a router-only MiX stage on a merged
    model. Returns the number of parameters left to train."""
    routers = [param for name, param in model.named_parameters() if ROUTER_PARAMETER in name]
    if not routers:
        raise ValueError(f"train_routers_only: {type(model).__name__} has no MLP routers (mlp.gate.*) to train.")
    model.requires_grad_(False)
    for param in routers:
        param.requires_grad_(True)
    return sum(param.numel() for param in routers)
