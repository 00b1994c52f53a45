"""`llama-moe upgrade`: bring a saved folder's model code, `auto_map` and model card up to the installed package."""


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "upgrade",
        help="rewrite a saved folder's model code, auto_map and card as the installed package writes them",
        description="Replace a converted or trained folder's remote code (configuration_*.py, modeling_*.py), "
        "config.json's auto_map and the model card's Usage section with the installed package's, all or nothing; "
        "the weights are not read or touched. An up-to-date folder is left as it is.",
    )
    parser.add_argument("folder", help="a folder written by `llama-moe convert` or a training recipe")
    parser.add_argument("--push-to-hub", action="store_true", help="also upload the changed files, in one commit")
    parser.add_argument("--repo-id", help="Hub repository ORG/NAME to upload to (with --push-to-hub)")
    parser.add_argument("--token", help="Hugging Face token (default: the logged-in one)")
    parser.add_argument("--dry-run", action="store_true", help="print what would change; change and upload nothing")


def run(args) -> None:
    from ..hub.upgrade import upgrade_folder

    if args.push_to_hub and not args.repo_id:
        raise ValueError("--push-to-hub needs --repo-id ORG/NAME.")
    if args.repo_id and not args.push_to_hub:
        raise ValueError("--repo-id names the repository --push-to-hub uploads to; add --push-to-hub.")
    result = upgrade_folder(args.folder, repo_id=args.repo_id, token=args.token, dry_run=args.dry_run)
    print(result.describe())
