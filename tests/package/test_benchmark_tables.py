"""The docs' benchmark tables are generated from benchmarks/results/*.jsonl (benchmarks/tables.py): the docs are up
to date with the results, `--check` catches a stale table, a rewrite fixes it, and `benchmarks.common.record` writes
rows that the tables read. Fast: no model, no torch work."""

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # `benchmarks`
from benchmarks import common, tables

STALE_DOC = """Some prose.

<!-- table: cli_start -->
| command | median | min | max |
|---|---|---|---|
| `python -c pass` | 9.99 | 9.99 | 9.99 |
<!-- /table -->

More prose.
"""


def test_the_docs_tables_match_the_results(capsys):
    assert tables.main(["--check"]) == 0, capsys.readouterr().out


def test_every_table_is_in_a_doc_and_every_marker_names_a_table():
    """Marked tables live in the user pages (docs/*.md) and the reports (benchmarks/reports/*.md)."""
    assert {path.parent for path in tables.doc_paths()} == {REPO / "docs", REPO / "benchmarks" / "reports"}
    marked = set()
    for path in tables.doc_paths():
        marked |= set(re.findall(r"^<!-- table: (\S+) -->$", path.read_text(), re.MULTILINE))
    known = set(tables.TABLES) | set(tables.SCRIPT_TABLES)
    assert marked == known, (marked - known, known - marked)


def test_check_fails_on_a_stale_table_and_a_rewrite_fixes_it(tmp_path, capsys):
    doc = tmp_path / "doc.md"
    doc.write_text(STALE_DOC)
    assert tables.main(["--check", str(doc)]) == 1
    assert "stale cli_start" in capsys.readouterr().out
    assert doc.read_text() == STALE_DOC  # --check changes nothing
    assert tables.main([str(doc)]) == 0
    text = doc.read_text()
    assert "9.99" not in text and "| `llama-moe --help` |" in text
    assert text.startswith("Some prose.") and text.endswith("More prose.\n")
    assert tables.main(["--check", str(doc)]) == 0


def test_recorded_rows_carry_their_run_command_machine_and_date(tmp_path):
    path = tmp_path / "cli_start.jsonl"
    for name in ("a", "b"):
        common.record("cli_start", {"table": "cli_start", "timed_command": name, "median": 1, "min": 1, "max": 1}, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all({"run", "command", "machine", "date"} <= set(row) for row in rows)
    older = {**rows[0], "run": "2000-01-01T00:00:00", "timed_command": "old"}
    assert tables.latest_run([older, *rows], "cli_start") == rows  # a table shows its latest run only


def test_cells_write_numbers_back_as_the_docs_show_them():
    assert tables.cell([3.239, 1.0], "{:.3f} ({:.2f})") == "3.239 (1.00)"
    assert tables.cell(-3.7, "{:+.1f}%") == "-3.7%"
    assert tables.cell(None, "{:.1f}") == ""
    assert tables.cell("eager", None) == "eager"
