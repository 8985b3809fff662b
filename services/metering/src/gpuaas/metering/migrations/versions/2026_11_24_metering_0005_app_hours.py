"""App-hours of launchable app instances (issue 21): which instances are launchable, since when they run and
up to when their app-hours are recorded. Additive: a defaulted flag and nullable columns.

Revision ID: metering_0005
Revises: metering_0004
Create Date: 2026-11-24 15:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "metering_0005"
down_revision: str | Sequence[str] | None = "metering_0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("instances", sa.Column("launchable", sa.Boolean(), nullable=False, server_default="false"))
    op.add_column("instances", sa.Column("running_since", sa.DateTime(timezone=True), nullable=True))
    op.add_column("instances", sa.Column("app_hours_until", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("instances", "app_hours_until")
    op.drop_column("instances", "running_since")
    op.drop_column("instances", "launchable")
