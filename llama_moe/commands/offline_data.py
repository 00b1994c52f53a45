"""`llama-moe offline-data`: small real training sets from what is on this machine (for the training recipes)."""

import dataclasses

from ..training.offline_data import OfflineDataOptions


def register(subparsers) -> None:
    subparsers.add_parser(
        "offline-data",
        help="build small real pre-training and SFT data sets from the Python standard library (no download)",
        description="Write pre-training domains (prose, code, math) and SFT tasks (chat, math, code) as JSON lines, "
        "each with a held-out test split, from the standard library's documentation and source and generated "
        "arithmetic word problems. The training recipes' demonstration data.",
        dataclass_types=[OfflineDataOptions],
    )


def run(args) -> None:
    from ..training.offline_data import build_offline_data

    options = OfflineDataOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(OfflineDataOptions)})
    for name, counts in build_offline_data(options).items():
        print(f"{options.output}/{name}: {counts['train']:,} train, {counts['test']:,} test")
