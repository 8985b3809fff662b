"""a resize up that waits for GPUs on its host (issue 29 item 2)

Additive only: nullable `pending_resize_gpus` (the size asked), `pending_resize_reason` (why it waits) and
`pending_resize_since` (its age in the queue) on `allocations`; set while an active allocation's resize up
waits, cleared when admission grants it, it is cancelled or the allocation is released. A partial index keeps
the admission cycle's read of the waiting resizes cheap.

Revision ID: allocations_0012
Revises: allocations_0011
Create Date: 2026-11-27
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "allocations_0012"
down_revision: str | None = "allocations_0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("allocations", sa.Column("pending_resize_gpus", sa.Integer, nullable=True))
    op.add_column("allocations", sa.Column("pending_resize_reason", sa.Text, nullable=True))
    op.add_column("allocations", sa.Column("pending_resize_since", sa.DateTime(timezone=True), nullable=True))
    op.create_index(
        "ix_allocations_pending_resize",
        "allocations",
        ["gpu_model"],
        postgresql_where=sa.text("pending_resize_gpus IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_allocations_pending_resize", table_name="allocations")
    op.drop_column("allocations", "pending_resize_since")
    op.drop_column("allocations", "pending_resize_reason")
    op.drop_column("allocations", "pending_resize_gpus")
