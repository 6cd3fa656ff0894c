"""The README's supported-models table, rendered from the coverage registry (families.py).

``python tests/coverage/model_table.py`` prints the table as Markdown; ``--write`` puts it into README.md between
the ``<!-- models:begin -->`` and ``<!-- models:end -->`` markers. test_model_table.py checks that the README holds
exactly this output, so a row can only say what test_matrix.py checks.

Families with the same attention features and the same outcomes share a row (at the first one's place in the
registry), which keeps the table short.
"""

import argparse
import pathlib
import sys

_HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # families.py and tests/models.py, when run as a script

from families import FAMILIES, MATCH, Family  # noqa: E402

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
BEGIN, END = "<!-- models:begin -->", "<!-- models:end -->"
HEADER = ("| model type | checkpoints | attention | `PagedCache` | `ContinuousBatcher` |\n"
          "|---|---|---|---|---|")  # fmt: skip


def _outcomes(family: Family) -> tuple[str, str]:
    """(PagedCache, engine) cells: "yes", the attention PagedCache still works with, or the refusal."""
    if family.expect == MATCH:
        return "yes", "yes"
    refused = f"refused: {family.reason}"
    if family.cache_attn:
        return f'with "{family.cache_attn}" attention', refused
    return refused, "refused"  # the reason is in the column before


def table() -> str:
    """The Markdown table, one row per group of families with equal features and outcomes."""
    rows: dict[tuple, list[Family]] = {}
    for family in FAMILIES:
        rows.setdefault((family.features, _outcomes(family)), []).append(family)
    lines = [HEADER]
    for (features, (cache, engine)), families in rows.items():
        names = ", ".join(f.label or f"`{f.name}`" for f in families)
        examples = ", ".join(f.examples for f in families)
        lines.append(f"| {names} | {examples} | {', '.join(features)} | {cache} | {engine} |")
    return "\n".join(lines)


def readme_table(text: str) -> str:
    """The README text between the markers, without the newlines next to them."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip("\n")


def write_readme(path: pathlib.Path = README) -> None:
    text = path.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    path.write_text(f"{text[:start]}\n{table()}\n{text[end:]}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"replace the table in {README} instead of printing")
    args = parser.parse_args(argv)
    if args.write:
        write_readme()
    else:
        print(table())


if __name__ == "__main__":
    main()
