"""Growing the schema of an existing store in place.

The rule: the schema only grows. A new fact goes into a new table (`create_all` makes it) or a
new *nullable* column of an existing table, which `add_missing_columns` adds with
`ALTER TABLE ... ADD COLUMN` when a store written by an older flexpipe is opened; old rows read
NULL there. Nothing is renamed, retyped or dropped, so an older flexpipe can still read a newer
file (it ignores the columns it does not know). A new NOT NULL column on an existing table
cannot be added this way; it is refused with a message instead of a half-migrated file.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import Table, inspect, text
from sqlalchemy.engine import Engine

__all__ = ["SchemaGrowthError", "add_missing_columns"]


class SchemaGrowthError(ValueError):
    """A column the code needs cannot be added to an existing table."""


def add_missing_columns(engine: Engine, tables: Iterable[Table]) -> list[str]:
    """Add each nullable column of `tables` that the database's table of that name lacks.
    Returns `table.column` for each column added (tables that do not exist are left to
    `create_all`)."""
    inspector = inspect(engine)
    existing = set(inspector.get_table_names())
    quote = engine.dialect.identifier_preparer.quote
    missing = []
    for table in tables:
        if table.name not in existing:
            continue
        have = {c["name"] for c in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name in have:
                continue
            if not column.nullable:
                raise SchemaGrowthError(
                    f"table {table.name} lacks column {column.name}, which is NOT NULL and "
                    "cannot be added in place; migrate this store by hand"
                )
            missing.append((table.name, column))
    added = []
    with engine.begin() as conn:
        for table_name, column in missing:
            type_sql = column.type.compile(dialect=engine.dialect)
            conn.execute(
                text(f"ALTER TABLE {quote(table_name)} ADD COLUMN {quote(column.name)} {type_sql}")
            )
            added.append(f"{table_name}.{column.name}")
    return added
