"""Alembic environment for the registry schema.

Run only through `tasks.registry.migrate.upgrade`, which hands over an open
connection (already inside a transaction and, on PostgreSQL, holding an advisory
lock so concurrent upgrades apply each migration once).
"""

from alembic import context

VERSION_TABLE = "retrainer_schema_version"

config = context.config
connection = config.attributes["connection"]
applied: list[str] = config.attributes.setdefault("applied", [])


def _record(*, ctx, step, heads, run_args) -> None:
    if step.is_upgrade:
        applied.append(step.up_revision_id)


context.configure(
    connection=connection,
    target_metadata=None,
    version_table=VERSION_TABLE,
    on_version_apply=_record,
)
with context.begin_transaction():
    context.run_migrations()
