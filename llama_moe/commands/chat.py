"""`llama-moe chat`: one greedy chat answer from a (converted) model, printed as it is generated."""


def register(subparsers) -> None:
    from ..loading import DTYPES

    parser = subparsers.add_parser(
        "chat",
        help="answer one prompt with greedy decoding and the chat template",
        description="Apply the tokenizer's chat template to one user turn, decode greedily and print the answer as "
        "it is generated.",
    )
    parser.add_argument("model", help="a local model folder, a Hub id ORG/NAME, or `default` (the built-in model)")
    parser.add_argument("--prompt", required=True, help="the user's message")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="compute dtype (default: auto, the checkpoint's own; float32 on a CPU without bf16 instructions)",
    )
    parser.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    parser.add_argument("--no-stream", action="store_true", help="print the answer once it is complete")


def run(args) -> None:
    from ..chat import chat

    answer = chat(
        args.model,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        dtype=args.dtype,
        stream=not args.no_stream,
        device=args.device,
    )
    if args.no_stream:
        print(answer)
