"""`llama-moe chat`: one greedy chat answer from a (converted) model folder."""


def register(subparsers) -> None:
    parser = subparsers.add_parser("chat", help="answer one prompt with greedy decoding and the chat template")
    parser.add_argument("folder")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)


def run(args) -> None:
    from ..conversion.chat import chat

    print(chat(args.folder, args.prompt, max_new_tokens=args.max_new_tokens))
