"""The device work runs on when the user names none: the first GPU where there is one, else the CPU."""


def default_device() -> str:
    import torch  # here, not at the top: the command line imports this module's users before it needs torch

    return "cuda" if torch.cuda.is_available() else "cpu"
