"""operations: the lease length of the current claim (heartbeats keep it) and a controller's deferral

Revision ID: app_runtime_0004
Revises: app_runtime_0003
Create Date: 2026-11-27
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "app_runtime_0004"
down_revision: str | Sequence[str] | None = "app_runtime_0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Both nullable without a default: adding them rewrites nothing (expand only).
    op.add_column("operations", sa.Column("lease_s", sa.Integer(), nullable=True))
    op.add_column("operations", sa.Column("deferred_until", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("operations", "deferred_until")
    op.drop_column("operations", "lease_s")
