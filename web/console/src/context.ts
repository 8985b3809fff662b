// Who is signed in, which projects they can act in, and which one is selected.
import { get } from "./api";

// eslint-disable-next-line @typescript-eslint/no-explicit-any
export type Obj = Record<string, any>;

export interface ProjectRef {
  project_id: string;
  tenant_id: string;
  name: string;
  tenant: string;
}

export interface Context {
  me: Obj;
  operator: boolean;
  tenantAdminOf: Set<string>;
  projects: ProjectRef[];
  project: ProjectRef | null;
}

let ctx: Context | null = null;
const KEY = "gpuaas.project";

export async function loadContext(force = false): Promise<Context> {
  if (ctx && !force) return ctx;
  const me = await get<Obj>("/api/identity/me");
  const memberships: Obj[] = me.memberships ?? [];
  const operator = memberships.some((m) => m.role === "platform_admin");
  const tenantAdminOf = new Set<string>(
    memberships.filter((m) => m.role === "tenant_admin" && m.tenant_id).map((m) => String(m.tenant_id)),
  );
  const projects = new Map<string, ProjectRef>();
  const tenantIds = new Set<string>(memberships.filter((m) => m.tenant_id).map((m) => String(m.tenant_id)));
  if (me.tenant_id) tenantIds.add(String(me.tenant_id));
  let tenants: Obj[] = [];
  if (operator) {
    try {
      tenants = await get<Obj[]>("/api/identity/tenants");
      for (const t of tenants) tenantIds.add(String(t.tenant_id));
    } catch {
      tenants = [];
    }
  }
  const tenantName = new Map<string, string>(tenants.map((t) => [String(t.tenant_id), String(t.name)]));
  for (const m of memberships) {
    if (m.project_id) {
      try {
        const p = await get<Obj>(`/api/identity/projects/${m.project_id}`);
        projects.set(p.project_id, { project_id: p.project_id, tenant_id: p.tenant_id, name: p.name, tenant: tenantName.get(p.tenant_id) ?? "" });
      } catch {
        // a project we can no longer read
      }
    }
  }
  for (const tid of tenantIds) {
    if (!operator && !tenantAdminOf.has(tid)) continue;
    try {
      const list = await get<Obj[]>(`/api/identity/tenants/${tid}/projects`);
      for (const p of list) projects.set(p.project_id, { project_id: p.project_id, tenant_id: p.tenant_id, name: p.name, tenant: tenantName.get(p.tenant_id) ?? "" });
    } catch {
      // not allowed to list this tenant's projects
    }
  }
  const list = [...projects.values()].sort((a, b) => (a.tenant + a.name).localeCompare(b.tenant + b.name));
  const saved = localStorage.getItem(KEY);
  const project = list.find((p) => p.project_id === saved) ?? list[0] ?? null;
  ctx = { me, operator, tenantAdminOf, projects: list, project };
  return ctx;
}

export function selectProject(projectId: string): void {
  localStorage.setItem(KEY, projectId);
  if (ctx) ctx.project = ctx.projects.find((p) => p.project_id === projectId) ?? ctx.project;
}

export function resetContext(): void {
  ctx = null;
}

export function current(): Context | null {
  return ctx;
}

/** billing.read: operators, the tenant's admins, the project's admins (the API decides; this avoids asking in vain). */
export function canReadBilling(c: Context, projectId: string | undefined, tenantId: string | undefined): boolean {
  if (c.operator) return true;
  if (tenantId && c.tenantAdminOf.has(tenantId)) return true;
  return (c.me.memberships ?? []).some((m: Obj) => m.role === "project_admin" && m.project_id === projectId);
}
