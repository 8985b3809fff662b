"""capacity queues: tenant and project queues per pool, and the waiting request's columns (issue 29)

Additive only: a new table `capacity_queues` (guarantee, limit, lend_limit, weight per scope and GPU model)
and nullable / defaulted columns on `allocations` (pending_reason, queue_position, priority, max_wait_s,
enqueued_at, on_preemption, requested_runtime), plus a partial index over `queued` allocations by pool.

Revision ID: allocations_0008
Revises: allocations_0007
Create Date: 2026-11-27
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "allocations_0008"
down_revision: str | None = "allocations_0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "capacity_queues",
        sa.Column("queue_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("scope", sa.Text(), nullable=False),
        sa.Column("scope_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("tenant_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("gpu_model", sa.Text(), nullable=False),
        sa.Column("guarantee", sa.Integer(), server_default="0", nullable=False),
        sa.Column("limit", sa.Integer(), nullable=True),
        sa.Column("lend_limit", sa.Integer(), nullable=True),
        sa.Column("weight", sa.Float(), server_default="1", nullable=False),
        sa.Column("version", sa.Integer(), server_default="1", nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("queue_id", name=op.f("pk_capacity_queues")),
        sa.CheckConstraint("scope IN ('tenant', 'project')", name=op.f("ck_capacity_queues_scope")),
        sa.CheckConstraint(
            'guarantee >= 0 AND weight > 0 AND ("limit" IS NULL OR "limit" >= guarantee) '
            "AND (lend_limit IS NULL OR lend_limit >= 0)",
            name=op.f("ck_capacity_queues_figures"),
        ),
    )
    op.create_index(
        "uq_capacity_queues_scope_model", "capacity_queues", ["scope", "scope_id", "gpu_model"], unique=True
    )
    op.create_index("ix_capacity_queues_model_tenant", "capacity_queues", ["gpu_model", "tenant_id"])
    op.add_column("allocations", sa.Column("pending_reason", sa.Text(), nullable=True))
    op.add_column("allocations", sa.Column("queue_position", sa.Integer(), nullable=True))
    op.add_column("allocations", sa.Column("priority", sa.Integer(), server_default="0", nullable=False))
    op.add_column("allocations", sa.Column("max_wait_s", sa.Integer(), nullable=True))
    op.add_column("allocations", sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("allocations", sa.Column("on_preemption", sa.Text(), server_default="release", nullable=False))
    op.add_column("allocations", sa.Column("requested_runtime", sa.Text(), nullable=True))
    op.create_index(
        "ix_allocations_queued",
        "allocations",
        ["gpu_model", "enqueued_at"],
        postgresql_where=sa.text("status = 'queued'"),
    )


def downgrade() -> None:
    op.drop_index("ix_allocations_queued", table_name="allocations", postgresql_where=sa.text("status = 'queued'"))
    for column in (
        "requested_runtime",
        "on_preemption",
        "enqueued_at",
        "max_wait_s",
        "priority",
        "queue_position",
        "pending_reason",
    ):
        op.drop_column("allocations", column)
    op.drop_index("ix_capacity_queues_model_tenant", table_name="capacity_queues")
    op.drop_index("uq_capacity_queues_scope_model", table_name="capacity_queues")
    op.drop_table("capacity_queues")
