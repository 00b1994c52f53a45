"""What export checks of a converted checkpoint (read by `checkpoints.converted.open_checkpoint`)."""


def check_compensation(checkpoint) -> list[str]:
    """G-MoEfication's compensation adds the rows of the experts a token did not select, which no target has; a
    table of zeros adds nothing and is left out (one ValueError otherwise; notes)."""
    config = checkpoint.config
    if not getattr(config, "moe_compensation", False):
        return []
    for layer in config.moe_layers:
        if checkpoint.tensor(f"model.layers.{layer}.mlp.compensation").any():
            raise ValueError(
                f"Cannot export moe_compensation exactly: layer {layer} adds the compensation rows of the experts a "
                "token did not select (G-MoEfication), which no target can express."
            )
    return ["moe_compensation: every compensation row is zero, so it adds nothing and is not exported"]
