"""`llama-moe batch-similar`: order documents by similarity and pack them into training sequences (SOAP's data)."""

import dataclasses

from ..similarity.options import BatchSimilarOptions


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "batch-similar",
        help="pack documents into training sequences, similar documents next to each other",
        description="Embed documents, chain each to its nearest unvisited neighbour, and pack the chain into token "
        "sequences (in-context pre-training; SOAP's similarity batching). Every document appears exactly once.",
        dataclass_types=[BatchSimilarOptions],
    )
    for action in parser._actions:
        if action.dest == "embedder":
            from ..similarity.embedders import EMBEDDERS

            action.choices = list(EMBEDDERS)


def run(args) -> None:
    from ..similarity.pipeline import batch_similar

    options = BatchSimilarOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BatchSimilarOptions)})
    result = batch_similar(options)
    stages = ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in result.seconds.items())
    counts = f"{result.sequences:,} sequences, {result.tokens:,} tokens, {result.documents:,} documents"
    print(f"wrote {result.output}: {counts}")
    print(f"time: {stages}")
