"""revocations: the deny list every service's token verification checks (gpuaas.kit.revocation).

Revision ID: kit_0004
Revises: kit_0003
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision: str = "kit_0004"
down_revision: str | Sequence[str] | None = "kit_0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "revocations",
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("key", UUID(as_uuid=True), nullable=False),
        sa.Column("not_before", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.clock_timestamp()),
        sa.PrimaryKeyConstraint("kind", "key", name=op.f("pk_revocations")),
    )
    op.create_index(op.f("ix_revocations_updated_at"), "revocations", ["updated_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_revocations_updated_at"), table_name="revocations")
    op.drop_table("revocations")
