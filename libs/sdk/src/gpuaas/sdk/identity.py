"""Identity: tokens (password, client credentials, refresh, SSO login code), discovery, the signed-in user,
tenants and projects."""

from __future__ import annotations

from typing import Any

import httpx

from gpuaas.sdk.models import Discovery, Me, Membership, Project, TokenResponse
from gpuaas.sdk.transport import ApiError, Id, Transport, problem_of

IDENTITY = "/api/identity"
TOKEN = f"{IDENTITY}/auth/token"


class IdentityApi(Transport):
    async def token_grant(self, grant_type: str, **form: str) -> TokenResponse:
        """`POST /auth/token` (no bearer): the answer only, the client's own token is left as it is."""
        data = await self.request("POST", TOKEN, data={"grant_type": grant_type, **form}, authenticated=False)
        return TokenResponse.model_validate(data)

    async def login(self, email: str, password: str) -> str:
        self.token = (await self.token_grant("password", username=email, password=password)).access_token
        return self.token

    async def login_client(self, client_id: str, client_secret: str, scope: str | None = None) -> str:
        """`client_credentials` for a project service account (e.g. an app controller)."""
        form = {"client_id": client_id, "client_secret": client_secret} | ({"scope": scope} if scope else {})
        self.token = (await self.token_grant("client_credentials", **form)).access_token
        return self.token

    def use_client_credentials(self, client_id: str, client_secret: str, scope: str | None = None) -> None:
        """Fetch a fresh service-account token whenever the current one is missing or rejected (401)."""

        async def provider() -> str:
            async with httpx.AsyncClient(base_url=str(self._http.base_url), timeout=30) as http:
                form = {"grant_type": "client_credentials", "client_id": client_id, "client_secret": client_secret}
                if scope:
                    form["scope"] = scope
                r = await http.post(TOKEN, data=form)
                if r.status_code >= 400:
                    raise ApiError(r.status_code, problem_of(r))
                return str(r.json()["access_token"])

        self.token = None
        self.token_provider = provider

    async def discover(self, email: str) -> Discovery:
        """Where an email signs in (password, or its organisation's IdP); asked before signing in."""
        data = await self.request("GET", f"{IDENTITY}/auth/discover", params={"email": email}, authenticated=False)
        return Discovery.model_validate(data)

    async def logout(self, refresh_token: str) -> None:
        """Revoke the session of this refresh token."""
        await self.request("POST", f"{IDENTITY}/auth/logout", data={"refresh_token": refresh_token})

    async def me(self) -> Me:
        return Me.model_validate(await self.request("GET", f"{IDENTITY}/me"))

    async def project(self, project_id: Id) -> Project:
        return Project.model_validate(await self.request("GET", f"{IDENTITY}/projects/{project_id}"))

    async def tenants(self) -> list[dict[str, Any]]:
        """Operators: every tenant; everyone else: the tenants they are a member of (`tenant_id`, `slug`, `name`)."""
        data: list[dict[str, Any]] = await self.request("GET", f"{IDENTITY}/tenants")
        return data

    async def tenant_projects(self, tenant_id: Id) -> list[Project]:
        """Tenant admins and operators: every project of the tenant; other members: their own."""
        data = await self.request("GET", f"{IDENTITY}/tenants/{tenant_id}/projects")
        return [Project.model_validate(p) for p in data]

    async def project_members(self, project_id: Id) -> list[Membership]:
        """The project's members, each with `email` and `display_name`."""
        data = await self.request("GET", f"{IDENTITY}/projects/{project_id}/members")
        return [Membership.model_validate(m) for m in data]

    async def create_tenant(self, slug: str, name: str) -> dict[str, Any]:
        return await self.request("POST", f"{IDENTITY}/tenants", json={"slug": slug, "name": name})

    async def create_project(self, tenant_id: Id, name: str) -> dict[str, Any]:
        return await self.request("POST", f"{IDENTITY}/tenants/{tenant_id}/projects", json={"name": name})

    async def create_user(
        self,
        tenant_id: Id,
        email: str,
        password: str,
        *,
        role: str | None = "project_member",
        project_id: Id | None = None,
        display_name: str = "",
    ) -> dict[str, Any]:
        """A user of the tenant (a tenant or project admin's call): with `role` tenant-wide, or in `project_id`
        (`project_admin` needs one), or with no role (`role=None`: add memberships later)."""
        body = {"email": email, "password": password, "display_name": display_name, "role": role}
        if project_id is not None:
            body["project_id"] = str(project_id)
        return await self.request("POST", f"{IDENTITY}/tenants/{tenant_id}/users", json=body)

    async def add_project_member(self, project_id: Id, user_id: Id, role: str) -> dict[str, Any]:
        """Give an existing user a role in the project (`project_admin`, `project_member`, `viewer`)."""
        body = {"user_id": str(user_id), "role": role}
        return await self.request("POST", f"{IDENTITY}/projects/{project_id}/members", json=body)

    async def audit(self, **params: Any) -> dict[str, Any]:
        return await self.request("GET", f"{IDENTITY}/audit", params=params)

    async def create_service_account(
        self, project_id: Id, name: str, scopes: list[str] | None = None
    ) -> dict[str, Any]:
        """A project service account (`scopes=["app-controller"]` for a controller); the answer's
        `client_secret` is shown only once."""
        body = {"name": name, "scopes": scopes or ["app-controller"]}
        data: dict[str, Any] = await self.request(
            "POST", f"{IDENTITY}/projects/{project_id}/service-accounts", json=body
        )
        return data
