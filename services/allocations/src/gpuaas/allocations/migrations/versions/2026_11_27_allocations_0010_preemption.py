"""preemption with notice (issue 29 item 4): the victim's deadline, reason and beneficiary; requeued copies

Additive only: nullable columns on `allocations` — `preempt_deadline` (when a scheduled preemption stops it),
`preempted_for` (the waiting request its GPUs are freed for; kept after the stop until that request is
admitted, so the freed GPUs are held for it), `preemption_reason`, `preemption_scheduled_at`, and
`requeued_from` (a requeued victim's new request points at the stopped allocation) — plus partial indexes over
the deadlines the reconciler checks and over `preempted_for` (the runner looks victims up from the waiting
requests of a pool, so the lookup does not grow with the history of preemptions).

Revision ID: allocations_0010
Revises: allocations_0008
Create Date: 2026-11-27
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "allocations_0010"
down_revision: str | None = "allocations_0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("allocations", sa.Column("preempt_deadline", sa.DateTime(timezone=True), nullable=True))
    op.add_column("allocations", sa.Column("preempted_for", postgresql.UUID(as_uuid=True), nullable=True))
    op.add_column("allocations", sa.Column("preemption_reason", sa.Text(), nullable=True))
    op.add_column("allocations", sa.Column("preemption_scheduled_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("allocations", sa.Column("requeued_from", postgresql.UUID(as_uuid=True), nullable=True))
    op.create_index(
        "ix_allocations_preempt_deadline",
        "allocations",
        ["preempt_deadline"],
        postgresql_where=sa.text("preempt_deadline IS NOT NULL"),
    )
    op.create_index(
        "ix_allocations_preempted_for",
        "allocations",
        ["preempted_for"],
        postgresql_where=sa.text("preempted_for IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index(
        "ix_allocations_preempted_for", table_name="allocations", postgresql_where=sa.text("preempted_for IS NOT NULL")
    )
    op.drop_index(
        "ix_allocations_preempt_deadline",
        table_name="allocations",
        postgresql_where=sa.text("preempt_deadline IS NOT NULL"),
    )
    for column in (
        "requeued_from",
        "preemption_scheduled_at",
        "preemption_reason",
        "preempted_for",
        "preempt_deadline",
    ):
        op.drop_column("allocations", column)
