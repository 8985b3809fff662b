"""allocation network: where the other allocations of its project reach an allocation

Additive only: one nullable JSONB column, `allocations.network` ({name, address, hostname, scope}), the
address the container driver's agent reports for the allocation on its project network.

Revision ID: allocations_0007
Revises: allocations_0006
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "allocations_0007"
down_revision: str | None = "allocations_0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("allocations", sa.Column("network", postgresql.JSONB(astext_type=sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column("allocations", "network")
