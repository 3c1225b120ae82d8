"""Alembic environment for the registry schema.

Run only with a config from `tasks.registry.migrate.alembic_config` (as `upgrade` does), which
hands over an open connection (already inside a transaction and, on PostgreSQL, holding an advisory
lock so concurrent upgrades apply each migration once) and the version table's name.
"""

from alembic import context

config = context.config
connection = config.attributes["connection"]
applied: list[str] = config.attributes.setdefault("applied", [])


def _record(*, ctx, step, heads, run_args) -> None:
    if step.is_upgrade:
        applied.append(step.up_revision_id)


context.configure(
    connection=connection,
    target_metadata=None,
    version_table=config.attributes["version_table"],
    on_version_apply=_record,
)
with context.begin_transaction():
    context.run_migrations()
