"""members projection (app usage member_id checked)

Revision ID: metering_0003
Revises: metering_0002
Create Date: 2026-11-24 11:35:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "metering_0003"
down_revision: str | Sequence[str] | None = "metering_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "members",
        sa.Column("member_id", sa.UUID(), nullable=False),
        sa.Column("instance_id", sa.UUID(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("member_id", name=op.f("pk_members")),
    )


def downgrade() -> None:
    op.drop_table("members")
