"""`llama-moe heal MOE_FOLDER --output DIR [--teacher DENSE]`: its flags are `HealOptions`."""

from ..conversion.healing import HealOptions


def register(subparsers) -> None:
    HealOptions._argument_group_name = "how to heal"
    parser = subparsers.add_parser(
        "heal",
        help="train a converted model's MoE MLPs, layer after layer, to reproduce its dense model",
        description="Heal an MoE folder written by llama-moe convert: each MoE MLP (router, experts, shared experts, "
        "compensation) is trained, on calibration tokens passed through the already-healed earlier layers, to "
        "reproduce the dense teacher's hidden states after its layer (--heal-target stream) or its MLP output "
        "(mlp). Written to a new folder, atomically; an interrupted run resumes at the "
        "next layer when run again. `llama-moe convert --heal-tokens N` does the same while converting.",
        dataclass_types=[HealOptions],
    )
    parser.add_argument("folder", help="converted model folder (written by llama-moe convert)")


def run(args) -> None:
    from dataclasses import fields

    from ..conversion.healing import heal_folder

    options = HealOptions(**{f.name: getattr(args, f.name) for f in fields(HealOptions)})
    output = heal_folder(args.folder, options)
    print(f"wrote {output}")
