"""`llama-moe push`: upload a converted folder, with its model card, to the Hugging Face Hub."""


def register(subparsers) -> None:
    parser = subparsers.add_parser("push", help="upload a converted folder (with its model card) to the Hub")
    parser.add_argument("folder", help="a converted model folder (written by llama-moe convert)")
    parser.add_argument("--repo-id", required=True, help="Hub repository ORG/NAME")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--token", help="Hugging Face token (default: the logged-in one)")
    parser.add_argument("--dry-run", action="store_true", help="print the files and the card, upload nothing")


def run(args) -> None:
    from ..hub.push import push_folder

    result = push_folder(args.folder, args.repo_id, private=args.private, token=args.token, dry_run=args.dry_run)
    print(result.describe() if args.dry_run else f"pushed: {result}")
