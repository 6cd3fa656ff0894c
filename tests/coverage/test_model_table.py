"""The README's supported-models table is the one model_table.py renders from the coverage registry."""

import model_table
from families import FAMILIES


def test_readme_table_is_generated_from_the_registry():
    readme = model_table.README.read_text()
    assert model_table.readme_table(readme) == model_table.table(), (
        "README.md's models table differs from the registry's: run python tests/coverage/model_table.py --write"
    )


def test_every_family_has_one_row():
    names = [name for row in model_table.table().splitlines()[2:] for name in row[2:].split(" | ")[0].split(", ")]
    assert sorted(names) == sorted(family.label or f"`{family.name}`" for family in FAMILIES)
