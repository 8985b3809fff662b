"""estimated start of a queued request (issue 29 item 2): when the GPUs freed for it will be free

Additive only: a nullable `estimated_start_at` on `allocations`, set when a preemption is scheduled for a
waiting request (the latest of its victims' deadlines plus their stop timeout) and shown while it is queued.

Revision ID: allocations_0011
Revises: allocations_0010
Create Date: 2026-11-27
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "allocations_0011"
down_revision: str | None = "allocations_0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("allocations", sa.Column("estimated_start_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("allocations", "estimated_start_at")
