"""Versions record what made them: the resolved training configuration and where training started.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04

`config` is the run's resolved job configuration as JSON (model sizes, layout, steps, learning rate,
data mixture, ...), with every credential redacted before it is written (tasks/base/credentials.py):
the hashes beside it say *which* config, this says *what* it was. `started_from` is one line
naming the weights training started from: `scratch`, `pretrained <directory>`, `version <N>` or
a weights path. Both nullable: NULL for every version published before this revision, which
recorded neither. The columns are added in place (ALTER TABLE ... ADD COLUMN): no row is
rewritten, so the append-only triggers of revision 0001 neither fire nor need recreating; a new
version gets both at insert, as versions are never updated.
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("registry_versions", sa.Column("config", sa.JSON, nullable=True))
    op.add_column("registry_versions", sa.Column("started_from", sa.Text, nullable=True))


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35): a batch copy would lose the immutability triggers.
    for column in ("started_from", "config"):
        op.drop_column("registry_versions", column)
