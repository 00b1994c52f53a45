"""Training recipes for converted MoE models: domain-mixture continual pre-training, two-stage SFT, checkpoints."""
