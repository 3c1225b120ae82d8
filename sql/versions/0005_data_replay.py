"""Versions record the replay sources their training mixture drew from.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03

`data_replay` is a JSON list of {url, manifest_hash, weight}: the earlier snapshots a run mixed
into training (`data.replay`), in order; the primary data (`data_url`, `data_manifest_hash`) had
the rest of the weight. Nullable: NULL means no replay, which is what every version published
before this revision trained with, and what a run without replay records. The column is added
in place (ALTER TABLE ... ADD COLUMN): no row is rewritten, so the append-only triggers of
revision 0001 neither fire nor need recreating.
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("registry_versions", sa.Column("data_replay", sa.JSON, nullable=True))


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35): a batch copy would lose the immutability triggers.
    op.drop_column("registry_versions", "data_replay")
