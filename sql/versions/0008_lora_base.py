"""A version records the base model it needs: `base_version` and `base_digest` (LoRA adapters, issue 28).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06

A LoRA run publishes an adapter trained on a frozen base: the adapter is useless without exactly that base.
`base_digest` is the base weights' identity (a registry tree digest, or a pretrained directory's listing
digest); `base_version` the registry version the base is, when it is one (NULL: a pretrained directory or
a seeded base). Both NULL for a full fine-tune, and for every version published before this revision. The
columns are added in place (ALTER TABLE ... ADD COLUMN): no row is rewritten, so the append-only
triggers of revision 0001 neither fire nor need recreating; a new version gets both at insert.
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("registry_versions", sa.Column("base_version", sa.Integer, nullable=True))
    op.add_column("registry_versions", sa.Column("base_digest", sa.String(64), nullable=True))


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35): a batch copy would lose the immutability triggers.
    for column in ("base_digest", "base_version"):
        op.drop_column("registry_versions", column)
