"""GPU usage attributed to app instances: members know their allocation and when they ran on it; usage
records carry the instance (issue 19). Additive: nullable columns and an index.

Revision ID: metering_0004
Revises: metering_0003
Create Date: 2026-11-24 15:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "metering_0004"
down_revision: str | Sequence[str] | None = "metering_0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("members", sa.Column("allocation_id", sa.UUID(), nullable=True))
    op.add_column("members", sa.Column("joined_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("members", sa.Column("left_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index("ix_members_allocation", "members", ["allocation_id"])
    op.add_column("usage_records", sa.Column("instance_id", sa.UUID(), nullable=True))


def downgrade() -> None:
    op.drop_column("usage_records", "instance_id")
    op.drop_index("ix_members_allocation", table_name="members")
    op.drop_column("members", "left_at")
    op.drop_column("members", "joined_at")
    op.drop_column("members", "allocation_id")
