"""The small SOAP replication of docs/soap.md: (a) dense, (b) SoapMoE, (c) SoapMoE with similarity batching, each
pre-trained with recipes/pretrain_soap.py for the same steps and tokens on the Python documentation.

Corpus: the reST sources of the Python 3.11 documentation (Debian's python3.11-doc, no Hub access needed), cut
into one document per section:

    apt-get download python3.11-doc && dpkg -x python3.11-doc_*.deb pydoc
    python benchmarks/quality/soap_replication.py prepare --pydoc pydoc --output outputs/pydoc.jsonl
    python benchmarks/quality/soap_replication.py run --documents outputs/pydoc.jsonl --output outputs/soap-replication

`run` trains the three variants one after another (same seed, same settings: recipes/pretrain/soap-small.yaml plus
the flags given after `--`) and prints a table of validation perplexity, tokens/s and expert utilisation.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {"dense": ["--variant", "dense"], "soap": [], "soap + similarity batching": ["--similarity_batching"]}
HEADING = re.compile(r"^\n?([=\-~^*#\"+`']){3,}\s*$")


def sections(text: str, min_chars: int = 200) -> list[str]:
    """A reST file cut before every section title (a line followed by an underline of =, -, ~, ...)."""
    lines, starts = text.splitlines(), [0]
    for i in range(1, len(lines)):
        if HEADING.match(lines[i]) and lines[i - 1].strip() and len(lines[i].strip()) >= len(lines[i - 1].strip()):
            starts.append(i - 1)
    starts.append(len(lines))
    chunks = ["\n".join(lines[a:b]).strip() for a, b in zip(starts, starts[1:])]
    return [chunk for chunk in chunks if len(chunk) >= min_chars]


def prepare(args) -> None:
    files = sorted(Path(args.pydoc).rglob("_sources/**/*.rst.txt"))
    if not files:
        sys.exit(f"error: no _sources/**/*.rst.txt under {args.pydoc} (see this script's docstring)")
    docs = [doc for file in files for doc in sections(file.read_text(encoding="utf-8", errors="replace"))]
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as out:
        for doc in docs:
            out.write(json.dumps({"text": doc}) + "\n")
    print(f"wrote {args.output}: {len(docs)} documents from {len(files)} files, {sum(map(len, docs)):,} characters")


def run(args, extra: list[str]) -> None:
    rows = []
    for name, flags in VARIANTS.items():
        output = Path(args.output) / name.replace(" + ", "-").replace(" ", "-")
        cmd = [sys.executable, str(ROOT / "recipes" / "pretrain_soap.py"), "--config", args.config]
        cmd += ["--documents", args.documents, "--output_dir", str(output), "--disable_tqdm", "true", *flags, *extra]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        rows.append((name, json.loads((output / "results.json").read_text())))
    print("| variant | parameters | validation perplexity | tokens/s | expert utilisation | mean top weight |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        routing = r.get("routing") or {}
        utilization = f"{100 * routing['utilization']:.0f}%" if routing else "-"
        top = f"{routing['mean_max_weight']:.3f}" if routing else "-"
        print(
            f"| {name} | {r['parameters'] / 1e6:.1f}M | {r['validation_perplexity']} | {r['tokens_per_second']} | "
            f"{utilization} | {top} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare")
    p.add_argument("--pydoc", required=True)
    p.add_argument("--output", required=True)
    r = commands.add_parser("run")
    r.add_argument("--documents", required=True)
    r.add_argument("--output", required=True)
    r.add_argument("--config", default=str(ROOT / "recipes" / "pretrain" / "soap-small.yaml"))
    args, extra = parser.parse_known_args()
    prepare(args) if args.command == "prepare" else run(args, [e for e in extra if e != "--"])


if __name__ == "__main__":
    main()
