"""isolated allocations: host driver/tenancy/pins, host classes, runtime projection, allocation runtime

Additive only: new nullable (or defaulted) columns on hosts and allocations, and three new tables:
`host_classes` (operator figures per class), `catalog_runtimes` and `catalog_artifacts` (a projection
of the catalog topic that allocation create resolves its `runtime` from).

Revision ID: allocations_0006
Revises: allocations_0005
Create Date: 2026-11-24
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "allocations_0006"
down_revision: str | None = "allocations_0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("hosts", sa.Column("driver", sa.Text(), nullable=True))
    op.add_column("hosts", sa.Column("isolates_tenants", sa.Boolean(), server_default="false", nullable=False))
    op.add_column("hosts", sa.Column("shared_tenancy_allowed", sa.Boolean(), server_default="false", nullable=False))
    op.add_column("hosts", sa.Column("cpu_count", sa.Integer(), nullable=True))
    op.add_column("hosts", sa.Column("memory_mb", sa.Integer(), nullable=True))
    op.add_column("hosts", sa.Column("ssh_host_key", sa.Text(), nullable=True))
    op.add_column("hosts", sa.Column("ssh_host_key_fingerprint", sa.Text(), nullable=True))
    op.add_column("allocations", sa.Column("runtime", postgresql.JSONB(astext_type=sa.Text()), nullable=True))
    op.add_column("allocations", sa.Column("driver", sa.Text(), nullable=True))
    op.add_column("allocations", sa.Column("limits", postgresql.JSONB(astext_type=sa.Text()), nullable=True))
    op.add_column("allocations", sa.Column("release_evidence", postgresql.JSONB(astext_type=sa.Text()), nullable=True))
    op.create_table(
        "host_classes",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("default_runtime", sa.Text(), nullable=True),
        sa.Column("cpus_per_gpu", sa.Float(), nullable=True),
        sa.Column("memory_mb_per_gpu", sa.Integer(), nullable=True),
        sa.Column("pids_limit", sa.Integer(), server_default="4096", nullable=False),
        sa.Column("version", sa.Integer(), server_default="1", nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_host_classes")),
    )
    op.create_table(
        "catalog_runtimes",
        sa.Column("manifest_id", sa.UUID(), nullable=False),
        sa.Column("slug", sa.Text(), nullable=False),
        sa.Column("app_version", sa.Text(), nullable=False),
        sa.Column("display_name", sa.Text(), server_default="", nullable=False),
        sa.Column("active", sa.Boolean(), nullable=False),
        sa.Column("deprecated", sa.Boolean(), nullable=False),
        sa.Column("artifact_ref", sa.Text(), nullable=False),
        sa.Column("artifact_id", sa.UUID(), nullable=True),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("manifest_id", name=op.f("pk_catalog_runtimes")),
    )
    op.create_index(op.f("ix_catalog_runtimes_slug"), "catalog_runtimes", ["slug"])
    op.create_table(
        "catalog_artifacts",
        sa.Column("artifact_id", sa.UUID(), nullable=False),
        sa.Column("ref", sa.Text(), nullable=False),
        sa.Column("digest", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("canary_tenants", postgresql.JSONB(astext_type=sa.Text()), server_default="[]", nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("artifact_id", name=op.f("pk_catalog_artifacts")),
    )
    op.create_index(op.f("ix_catalog_artifacts_ref"), "catalog_artifacts", ["ref"])
    op.create_index(op.f("ix_catalog_artifacts_digest"), "catalog_artifacts", ["digest"])


def downgrade() -> None:
    op.drop_index(op.f("ix_catalog_artifacts_digest"), table_name="catalog_artifacts")
    op.drop_index(op.f("ix_catalog_artifacts_ref"), table_name="catalog_artifacts")
    op.drop_table("catalog_artifacts")
    op.drop_index(op.f("ix_catalog_runtimes_slug"), table_name="catalog_runtimes")
    op.drop_table("catalog_runtimes")
    op.drop_table("host_classes")
    for column in ("release_evidence", "limits", "driver", "runtime"):
        op.drop_column("allocations", column)
    for column in (
        "ssh_host_key_fingerprint",
        "ssh_host_key",
        "memory_mb",
        "cpu_count",
        "shared_tenancy_allowed",
        "isolates_tenants",
        "driver",
    ):
        op.drop_column("hosts", column)
