"""controller states: a controller's own versioned state per instance (the SDK's StoredState)

Revision ID: app_runtime_0003
Revises: app_runtime_0002
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "app_runtime_0003"
down_revision: str | Sequence[str] | None = "app_runtime_0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "controller_states",
        sa.Column("instance_id", sa.UUID(), nullable=False),
        sa.Column("state", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("updated_by", sa.Text(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.ForeignKeyConstraint(
            ["instance_id"], ["instances.instance_id"], name=op.f("fk_controller_states_instance_id_instances")
        ),
        sa.PrimaryKeyConstraint("instance_id", name=op.f("pk_controller_states")),
    )


def downgrade() -> None:
    op.drop_table("controller_states")
