"""Versions record the kind of artifact they point to: one file, or a content-addressed tree.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02

`artifact_kind` is 'file' (one object at `<store>/sha256/<2 hex>/<digest>`, the only kind
before this revision) or 'tree' (a directory at `<store>/trees/<2 hex>/<digest>/` whose
`manifest.json` hashes to the digest; tasks/registry/tree.py). NOT NULL with the server
default 'file', so every version published before this revision reads as what it is. The
column is added in place (ALTER TABLE ... ADD COLUMN): no row is rewritten, so the
append-only triggers of revision 0001 neither fire nor need recreating. PostgreSQL also
refuses any other value (a CHECK constraint); SQLite cannot add one to an existing table
without copying it, and relies on the registry code's own check.
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

CHECK_NAME = "ck_registry_versions_artifact_kind"


def upgrade() -> None:
    op.add_column(
        "registry_versions",
        sa.Column("artifact_kind", sa.String(16), nullable=False, server_default="file"),
    )
    if op.get_bind().dialect.name == "postgresql":
        op.create_check_constraint(CHECK_NAME, "registry_versions", "artifact_kind IN ('file', 'tree')")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.drop_constraint(CHECK_NAME, "registry_versions", type_="check")
    # Plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35): a batch copy would lose the immutability triggers.
    op.drop_column("registry_versions", "artifact_kind")
