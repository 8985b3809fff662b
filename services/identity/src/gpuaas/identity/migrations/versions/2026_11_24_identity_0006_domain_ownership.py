"""domain ownership, oauth client tenant

An email domain is claimed by a tenant's IdP with a challenge token and serves discovery, linking and
enforced SSO only once proven (DNS TXT record or operator attestation). Several IdPs may claim a
domain; a proven domain belongs to one (partial unique index). Claims made before this revision were
never proven: they stay as claims, with a fresh challenge each, and must be proven again.
An OIDC client may belong to one tenant (serves only its users); existing clients stay platform-wide.

Revision ID: identity_0006
Revises: identity_0005
Create Date: 2026-11-24 11:40:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "identity_0006"
down_revision: str | Sequence[str] | None = "identity_0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("idp_domains", sa.Column("challenge", sa.Text(), nullable=True))
    op.execute("UPDATE idp_domains SET challenge = replace(gen_random_uuid()::text, '-', '')")
    op.alter_column("idp_domains", "challenge", nullable=False)
    op.add_column("idp_domains", sa.Column("verified_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("idp_domains", sa.Column("verified_by", sa.Text(), nullable=True))
    op.drop_constraint("pk_idp_domains", "idp_domains", type_="primary")
    op.create_primary_key("pk_idp_domains", "idp_domains", ["domain", "idp_id"])
    op.create_index(
        "ux_idp_domains_verified",
        "idp_domains",
        ["domain"],
        unique=True,
        postgresql_where=sa.text("verified_at IS NOT NULL"),
    )
    op.add_column("oauth_clients", sa.Column("tenant_id", sa.UUID(), nullable=True))
    op.create_foreign_key(
        op.f("fk_oauth_clients_tenant_id_tenants"), "oauth_clients", "tenants", ["tenant_id"], ["tenant_id"]
    )


def downgrade() -> None:
    op.drop_constraint(op.f("fk_oauth_clients_tenant_id_tenants"), "oauth_clients", type_="foreignkey")
    op.drop_column("oauth_clients", "tenant_id")
    op.drop_index("ux_idp_domains_verified", table_name="idp_domains")
    op.execute("DELETE FROM idp_domains WHERE verified_at IS NULL")
    op.drop_constraint("pk_idp_domains", "idp_domains", type_="primary")
    op.create_primary_key("pk_idp_domains", "idp_domains", ["domain"])
    op.drop_column("idp_domains", "verified_by")
    op.drop_column("idp_domains", "verified_at")
    op.drop_column("idp_domains", "challenge")
