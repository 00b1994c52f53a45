"""Write the held-out texts of `benchmarks/common.py` under data/heldout/ from what this machine has (no Hub).

    apt-get download python3.11-doc && dpkg -x python3.11-doc_*.deb /tmp/pydoc     # the Python docs' sources
    python benchmarks/quality/make_heldout.py --python-docs /tmp/pydoc

- tutorial, howto: CPython's Doc/tutorial and Doc/howto (.rst.txt), the texts settings are chosen and confirmed on;
  the domain of the built-in calibration corpus's docstrings (Python documentation).
- licences: Debian's /usr/share/common-licenses (GPL, LGPL, MPL, Apache, GFDL, Artistic...): legal prose.
- manpages: every 150th section-1 manual page of /usr/share/man, rendered as `man` shows it at 80 columns: command
  manuals of many tools.

The last two are of other domains than any calibration corpus here, the texts a claim is confirmed on.

`--builtin-corpus NAME` also writes data/calibration/builtin-NAME.jsonl, one of the package's built-in corpora
(`llama_moe/text/corpus.py`: `docstrings`, the default calibration text, or `mixed`) as JSON lines, for recipes
that read files (`recipes/pretrain/joint-heal.yaml`).

`--domain-matched` writes data/calibration/domain-matched.jsonl, a diagnostic calibration text of the confirming
texts' own domains (benchmarks/reports/calibration-and-levers.md, "What holds the other domains"): the docstrings,
the licence notices of /usr/share/doc/*/copyright and section-1 manual pages that the held-out text does not use, a
document of each in turn, each cut at 2,000 characters. A paragraph that shares any 8 words in a row with the held-out licences or manual pages
is left out, so no held-out sentence is calibrated on.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LICENCES = Path("/usr/share/common-licenses")
MAN1 = Path("/usr/share/man/man1")
MAN_STRIDE = 150
SHINGLE_WORDS = 8  # a paragraph sharing this many words in a row with the held-out text is left out


def python_docs(unpacked: Path, output: Path) -> None:
    sources = unpacked / "usr/share/doc/python3.11/html/_sources"
    if not sources.is_dir():
        raise SystemExit(f"{sources} is missing: unpack python3.11-doc there first (see the docstring).")
    for name in ("tutorial", "howto"):
        shutil.rmtree(output / name, ignore_errors=True)
        shutil.copytree(sources / name, output / name)


def licences(output: Path) -> int:
    folder = output / "licences"
    folder.mkdir(parents=True, exist_ok=True)
    files = sorted(path for path in LICENCES.iterdir() if path.is_file() and not path.is_symlink())
    for path in files:
        (folder / f"{path.name}.txt").write_text(path.read_text(errors="replace"))
    return len(files)


def render_man_page(page: Path) -> str:
    """A manual page as `man` shows it at 80 columns, overstrikes removed (empty if it does not render)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "MANWIDTH": "80", "LANG": "C.UTF-8"}
    shown = subprocess.run(["man", "-l", str(page)], capture_output=True, text=True, env=env, check=False)
    return subprocess.run(["col", "-bx"], input=shown.stdout, capture_output=True, text=True, check=False).stdout


def manpages(output: Path) -> int:
    folder = output / "manpages"
    folder.mkdir(parents=True, exist_ok=True)
    written = 0
    for page in sorted(MAN1.glob("*.1.gz"))[::MAN_STRIDE]:
        text = render_man_page(page)
        if text.strip():
            (folder / f"{page.name.removesuffix('.1.gz')}.txt").write_text(text)
            written += 1
    return written


def shingles(text: str) -> set[tuple[str, ...]]:
    words = text.lower().split()
    return {tuple(words[i : i + SHINGLE_WORDS]) for i in range(len(words) - SHINGLE_WORDS + 1)}


def unseen_paragraphs(text: str, seen: set[tuple[str, ...]]) -> str:
    """`text` without the paragraphs that share a shingle with `seen` (the held-out text) and without lines of the form
    `Field: value` (Debian's copyright format's field lines, `Files: *`, lists of names rather than licence prose; a
    manual page's line of that form goes too)."""
    text = re.sub(r"(?m)^([A-Z][\w-]*:.*|\s*\.\s*)$", "", text)
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip() and not shingles(p) & seen]
    return "\n\n".join(paragraphs)


def domain_matched(heldout: Path, output: Path) -> int:
    """Docstrings, licence notices and unused manual pages in turn (the module docstring), as JSON lines. Reads the
    held-out licences and manual pages under `heldout`, so they must be written first."""
    from llama_moe.text.corpus import builtin_corpus as corpus
    from llama_moe.text.corpus import in_turn

    held_out = [p for kind in ("licences", "manpages") for p in sorted((heldout / kind).glob("*.txt"))]
    seen = set().union(*(shingles(p.read_text()) for p in held_out))
    notices = (p.read_text(errors="replace") for p in sorted(Path("/usr/share/doc").glob("*/copyright")))
    unused = [page for i, page in enumerate(sorted(MAN1.glob("*.1.gz"))) if i % MAN_STRIDE]  # not held out
    pages = (render_man_page(page) for page in unused[:: MAN_STRIDE // 4])
    kinds = [corpus("docstrings")[0], *([unseen_paragraphs(t, seen) for t in texts] for texts in (notices, pages))]
    texts = in_turn([t for t in kind if t.strip()] for kind in kinds)
    output.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return len(texts)


def builtin_corpus(name: str, output: Path) -> int:
    """One of the package's built-in corpora as JSON lines, for what reads files (a recipe's `domains`)."""
    from llama_moe.text.corpus import builtin_corpus as corpus

    texts, _ = corpus(name)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return len(texts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python-docs", type=Path, help="where python3.11-doc was unpacked (dpkg -x)")
    parser.add_argument("--output", type=Path, default=ROOT / "data" / "heldout")
    parser.add_argument(
        "--builtin-corpus", choices=["docstrings", "mixed"], help="also write data/calibration/builtin-NAME.jsonl"
    )
    parser.add_argument(
        "--domain-matched", action="store_true", help="also write data/calibration/domain-matched.jsonl (a diagnostic)"
    )
    args = parser.parse_args()
    if args.builtin_corpus:
        output = ROOT / "data" / "calibration" / f"builtin-{args.builtin_corpus}.jsonl"
        print(f"built-in corpus {args.builtin_corpus}: {builtin_corpus(args.builtin_corpus, output)} documents")
    if args.python_docs:
        python_docs(args.python_docs, args.output)
    print(f"licences: {licences(args.output)} files; manpages: {manpages(args.output)} pages -> {args.output}")
    if args.domain_matched:  # after the held-out text it must leave out
        output = ROOT / "data" / "calibration" / "domain-matched.jsonl"
        output.parent.mkdir(parents=True, exist_ok=True)
        print(f"domain-matched calibration text: {domain_matched(args.output, output)} documents -> {output}")


if __name__ == "__main__":
    main()
