import { describe, get, post, put } from "../api";
import type { Context, Obj } from "../context";
import { badge, clear, field, h, table, when } from "../dom";

export async function hosts(main: HTMLElement): Promise<void> {
  const list = await get<Obj[]>("/api/allocations/hosts");
  const notice = h("p", { role: "status", "aria-live": "polite" });
  const act = async (hostId: string, what: string) => {
    try {
      await post(`/api/allocations/hosts/${hostId}/${what}`, what === "cordon" || what === "drain" ? { reason: `${what} from the web console` } : {});
      notice.textContent = `${what}: done.`;
      clear(main);
      await hosts(main);
    } catch (ex) {
      notice.textContent = `${what} failed: ${describe(ex)}`;
    }
  };
  // Shared tenancy: a host whose driver does not isolate tenants takes one tenant at a time unless the
  // operator allows sharing (audited, with the reason).
  const setTenancy = async (x: Obj) => {
    const allow = !x.shared_tenancy_allowed;
    try {
      await put(`/api/allocations/hosts/${x.host_id}/tenancy`, {
        shared_tenancy_allowed: allow,
        reason: allow ? "tenants may share this host (set from the web console)" : "one tenant at a time (set from the web console)",
      });
      notice.textContent = `tenancy of ${x.name}: ${allow ? "shared allowed" : "one tenant at a time"}.`;
      clear(main);
      await hosts(main);
    } catch (ex) {
      notice.textContent = `tenancy change failed: ${describe(ex)}`;
    }
  };
  const tenancy = (x: Obj): string =>
    x.isolates_tenants ? "isolated (tenants may share)" : x.shared_tenancy_allowed ? "shared allowed by an operator" : "one tenant at a time";
  main.append(
    h("h1", null, "Hosts"),
    notice,
    table(
      ["Name", "Status", "Class", "GPUs", "Driver", "Tenancy", "CPUs / memory", "Host key", "Inventory", "Agent", "Last heartbeat", ""],
      list.map((x) => [
        x.name,
        [badge(x.status), x.cordon_reason ? ` ${x.cordon_reason}` : ""],
        x.host_class ?? "—",
        `${(x.gpus ?? []).length} × ${(x.gpus ?? [])[0]?.model ?? "—"}`,
        h("span", { "data-driver": x.driver ?? "" }, x.driver ?? "—"),
        h("span", { "data-isolates": String(Boolean(x.isolates_tenants)), "data-shared": String(Boolean(x.shared_tenancy_allowed)) }, tenancy(x)),
        x.cpu_count ? `${x.cpu_count} / ${Math.round((x.memory_mb ?? 0) / 1024)} GiB` : "—",
        x.ssh_host_key_fingerprint ? h("code", { title: x.ssh_host_key_fingerprint }, `${String(x.ssh_host_key_fingerprint).slice(0, 19)}…`) : "not pinned",
        x.inventory_source,
        x.agent_version ?? "—",
        when(x.last_heartbeat_at),
        h(
          "span",
          { class: "inline" },
          x.status === "cordoned"
            ? h("button", { type: "button", class: "secondary", onclick: () => act(x.host_id, "uncordon") }, "Uncordon")
            : h("button", { type: "button", class: "secondary", onclick: () => act(x.host_id, "cordon") }, "Cordon"),
          h("button", { type: "button", class: "secondary", onclick: () => act(x.host_id, "drain") }, "Drain"),
          x.isolates_tenants
            ? null
            : h("button", { type: "button", class: "secondary", onclick: () => setTenancy(x) }, x.shared_tenancy_allowed ? `Stop sharing ${x.name}` : `Allow sharing ${x.name}`),
        ),
      ]),
      "Enrolled hosts",
    ),
  );
  await hostClasses(main);
}

/** Host classes: the default runtime and the per-GPU CPU/memory share and pids limit of allocations. */
async function hostClasses(main: HTMLElement): Promise<void> {
  const section = h("section", { "aria-labelledby": "h-host-classes" }, h("h2", { id: "h-host-classes" }, "Host classes"));
  main.append(section);
  try {
    const classes = await get<Obj[]>("/api/allocations/host-classes");
    section.append(
      table(
        ["Class", "Default runtime", "CPUs per GPU", "Memory per GPU", "Pids limit"],
        classes.map((c) => [c.name, c.default_runtime ?? "platform default", c.cpus_per_gpu ?? "host share", c.memory_mb_per_gpu ? `${c.memory_mb_per_gpu} MB` : "host share", c.pids_limit ?? "—"]),
        "Host classes",
      ),
    );
  } catch (ex) {
    section.append(h("p", { class: "muted" }, `Host classes are not available: ${describe(ex)}`));
  }
}

export async function artifacts(main: HTMLElement): Promise<void> {
  const list = await get<Obj[]>("/api/catalog/artifacts", { limit: 100 });
  const history = h("section", { "aria-live": "polite", "aria-labelledby": "h-history" });
  const show = async (a: Obj) => {
    try {
      const rows = await get<Obj[]>(`/api/catalog/artifacts/${a.artifact_id}/history`);
      clear(
        history,
        h("h2", { id: "h-history" }, `Promotions of ${a.repository}@${a.digest.slice(0, 19)}…`),
        table(["From", "To", "Actor", "Reason", "When"], rows.map((r) => [r.from_state ?? "—", r.to_state, `${r.actor_kind}:${String(r.actor_id).slice(0, 8)}`, r.reason, when(r.occurred_at)])),
      );
    } catch (ex) {
      clear(history, h("p", { class: "error" }, describe(ex)));
    }
  };
  main.append(
    h("h1", null, "Artifacts and promotions"),
    table(
      ["Repository", "Digest", "Kind", "State", "Signature", "Checks", ""],
      list.map((a) => [
        `${a.registry}/${a.repository}`,
        h("code", null, `${a.digest.slice(0, 19)}…`),
        a.kind,
        badge(a.state),
        a.signature_verified ? "verified" : "not verified",
        (a.checks ?? []).map((c: Obj) => `${c.kind ?? c.name}: ${c.passed ?? c.status ?? ""}`).join(", ") || "—",
        h("button", { type: "button", class: "secondary", onclick: () => show(a) }, "History"),
      ]),
      "Artifacts",
    ),
    history,
  );
}

export async function entitlements(main: HTMLElement, _p: string[], _ctx: Context): Promise<void> {
  const [list, tenants] = await Promise.all([get<Obj[]>("/api/catalog/entitlements"), get<Obj[]>("/api/identity/tenants").catch(() => [] as Obj[])]);
  const names = new Map(tenants.map((t) => [t.tenant_id, t.name]));
  const tenant = h("select", { required: true }, tenants.map((t) => h("option", { value: t.tenant_id }, t.name)));
  const slug = h("input", { required: true, placeholder: "jupyter" });
  const err = h("p", { class: "error", role: "alert", hidden: true });
  main.append(
    h("h1", null, "Entitlements"),
    table(
      ["Tenant", "App", "Status", "Granted", ""],
      list.map((e) => [
        names.get(e.tenant_id) ?? e.tenant_id,
        e.app_slug,
        badge(e.status),
        when(e.granted_at),
        e.status === "active"
          ? h("button", { type: "button", class: "secondary", onclick: async () => { await post(`/api/catalog/entitlements/${e.entitlement_id}/revoke`, { reason: "revoked from the web console" }).catch((ex) => ((err.textContent = describe(ex)), (err.hidden = false))); clear(main); await entitlements(main, _p, _ctx); } }, "Revoke")
          : "",
      ]),
      "Which tenants may deploy which apps",
    ),
    h(
      "form",
      {
        class: "inline-form",
        onsubmit: async (ev: Event) => {
          ev.preventDefault();
          try {
            await post("/api/catalog/entitlements", { tenant_id: tenant.value, app_slug: slug.value.trim() });
            clear(main);
            await entitlements(main, _p, _ctx);
          } catch (ex) {
            err.textContent = describe(ex);
            err.hidden = false;
          }
        },
      },
      h("h2", null, "Grant an entitlement"),
      field("Tenant", tenant),
      field("App slug", slug),
      err,
      h("button", { type: "submit" }, "Grant"),
    ),
  );
}

const SERVICES = ["identity", "allocations", "catalog", "app-runtime", "metering", "billing"];

export async function deadLetters(main: HTMLElement): Promise<void> {
  main.append(h("h1", null, "Dead letters"), h("p", { class: "muted" }, "Events a consumer failed to handle after its retries, per service; retry them once fixed."));
  const results = await Promise.all(SERVICES.map((s) => get<Obj>(`/api/${s}/admin/dead-letters`).then((p) => ({ s, p }), (ex) => ({ s, ex }))));
  for (const r of results) {
    const section = h("section", { "aria-labelledby": `dl-${r.s}` }, h("h2", { id: `dl-${r.s}` }, r.s));
    if ("ex" in r) section.append(h("p", { class: "muted" }, describe(r.ex)));
    else
      section.append(
        table(
          ["Event", "Consumer", "Error", "Attempts", "Status", "Since", ""],
          (r.p.items as Obj[]).map((d) => [
            d.event_type ?? "—",
            d.consumer,
            h("code", null, String(d.error).slice(0, 200)),
            d.attempts,
            badge(d.status),
            when(d.created_at),
            d.status === "parked" ? h("button", { type: "button", class: "secondary", onclick: async () => { await post(`/api/${r.s}/admin/dead-letters/${d.id}/retry`).catch(() => null); clear(main); await deadLetters(main); } }, "Retry") : "",
          ]),
        ),
      );
    main.append(section);
  }
}

export async function auditLog(main: HTMLElement, _p: string[], ctx: Context): Promise<void> {
  const action = h("input", { name: "action", placeholder: "e.g. allocations.create" });
  const service = h("select", { name: "service" }, h("option", { value: "" }, "any"), SERVICES.map((s) => h("option", { value: s.replace("-", "_") }, s)));
  const box = h("div", { "aria-live": "polite" });
  const load = async () => {
    const tenantId = ctx.operator ? undefined : [...ctx.tenantAdminOf][0];
    const page = await get<Obj>("/api/identity/audit", { action: action.value || undefined, service: service.value || undefined, tenant_id: tenantId, limit: 100 });
    clear(
      box,
      h("p", { class: "muted" }, `${page.total} record(s)`),
      table(
        ["When", "Service", "Action", "Actor", "Resource", "Outcome", "Reason"],
        (page.items as Obj[]).map((a) => [when(a.occurred_at), a.service, a.action, `${a.actor_kind}:${String(a.actor_id).slice(0, 8)}`, `${a.resource_type}/${String(a.resource_id).slice(0, 8)}`, a.outcome, a.reason ?? ""]),
        "Audit records, newest first",
      ),
    );
  };
  main.append(
    h("h1", null, "Audit log"),
    h(
      "form",
      {
        class: "inline-form filters",
        role: "search",
        onsubmit: (e: Event) => {
          e.preventDefault();
          void load();
        },
      },
      field("Action", action),
      field("Service", service),
      h("button", { type: "submit" }, "Filter"),
    ),
    box,
  );
  await load();
}
