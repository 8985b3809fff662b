import { describe, get, post, streamEvents, token } from "../api";
import type { Context, Obj } from "../context";
import { badge, clear, field, h, table, when } from "../dom";
import { go, type Cleanup } from "../nav";

const C = "/api/catalog";
const R = "/api/app-runtime";

async function activeAllocations(ctx: Context): Promise<Obj[]> {
  if (!ctx.project) return [];
  const all = await get<Obj[]>(`/api/allocations/projects/${ctx.project.project_id}/allocations`).catch(() => [] as Obj[]);
  return all.filter((a) => a.status === "active");
}

function requirements(c: Obj): string {
  const parts: string[] = [];
  if (c.requires_capacity_shape) parts.push(`${c.requires_capacity_shape} only`);
  if (c.min_gpu_count) parts.push(`≥ ${c.min_gpu_count} GPUs`);
  if (c.requires_exclusive_node) parts.push("exclusive node");
  if (c.multi_allocation) parts.push("spans several allocations");
  return parts.join(", ") || "any allocation";
}

export async function appCatalog(main: HTMLElement, _p: string[], ctx: Context): Promise<void> {
  main.append(h("h1", null, "App catalog"));
  const tenantId = ctx.project?.tenant_id;
  const [apps, allocs] = await Promise.all([get<Obj[]>(`${C}/apps`, { tenant_id: tenantId }), activeAllocations(ctx)]);
  if (!apps.length) {
    main.append(h("p", { class: "empty" }, "No app is available to your organisation yet: an operator grants entitlements."));
    return;
  }
  const biggest = allocs.reduce<Obj | null>((best, a) => (!best || a.gpu_count > best.gpu_count ? a : best), null);
  const grid = h("div", { class: "cards" });
  main.append(
    h("p", { class: "muted" }, allocs.length ? `Compatibility is checked against your ${allocs.length} active allocation(s) in ${ctx.project?.name}.` : "You have no active allocation: create one to deploy apps."),
    grid,
  );
  for (const app of apps) {
    const verdict = h("p", { class: "verdict", "aria-live": "polite" }, biggest ? "Checking compatibility…" : "No active allocation to check against.");
    const card = h(
      "article",
      { class: "card app", "aria-labelledby": `app-${app.slug}` },
      h("h2", { id: `app-${app.slug}` }, app.display_name),
      h("p", null, app.description || ""),
      h(
        "dl",
        { class: "facts" },
        h("dt", null, "App version"),
        h("dd", null, app.version),
        h("dt", null, "Runtime"),
        h("dd", null, app.runtime_version ?? "—"),
        h("dt", null, "Kind"),
        h("dd", null, app.artifact_kind),
        h("dt", null, "Needs"),
        h("dd", null, requirements(app.compatibility ?? {})),
        h("dt", null, "Artifact"),
        h("dd", null, badge(app.artifact_state ?? "unknown"), app.deprecated ? " deprecated" : ""),
      ),
      verdict,
      h("a", { class: "button primary", href: `#/apps/${app.slug}/deploy` }, `Deploy ${app.display_name}`),
    );
    grid.append(card);
    if (biggest) {
      post<Obj>(`${C}/apps/${app.slug}/compatibility`, {
        tenant_id: tenantId,
        capacity_shape: biggest.shape,
        gpu_count: biggest.gpu_count,
        exclusive_node: biggest.shape === "baremetal",
        allocation_count: allocs.length,
      })
        .then((v) => {
          const reasons = (v.reasons ?? []).map((r: Obj) => r.message ?? r.detail ?? r.code ?? JSON.stringify(r));
          verdict.textContent = v.deployable ? "Deployable on your allocations." : `Not deployable: ${reasons.join("; ") || "incompatible"}`;
          verdict.dataset.deployable = String(v.deployable);
        })
        .catch((ex) => (verdict.textContent = `Compatibility unknown: ${describe(ex)}`));
    }
  }
}

/** One form control per property of the manifest's `inputs` JSON Schema (exactly those). */
function inputControls(schema: Obj): Array<{ name: string; el: HTMLElement; read: () => unknown }> {
  const props: Obj = schema.properties ?? {};
  const required = new Set<string>(schema.required ?? []);
  return Object.entries(props).map(([name, s]) => {
    const label = `${s.title ?? name}${required.has(name) ? " (required)" : ""}`;
    const help = s.description as string | undefined;
    if (Array.isArray(s.enum)) {
      const sel = h("select", { name, required: required.has(name) }, s.enum.map((v: unknown) => h("option", { value: String(v), selected: v === s.default }, String(v))));
      return { name, el: field(label, sel, help), read: () => sel.value };
    }
    if (s.type === "boolean") {
      const box = h("input", { type: "checkbox", name, checked: Boolean(s.default) });
      return { name, el: h("div", { class: "field" }, h("label", { class: "inline" }, box, ` ${label}`), help ? h("p", { class: "help" }, help) : null), read: () => box.checked };
    }
    if (s.type === "integer" || s.type === "number") {
      const num = h("input", { type: "number", name, required: required.has(name), min: s.minimum, max: s.maximum, step: s.type === "integer" ? 1 : "any", value: s.default });
      return { name, el: field(label, num, help), read: () => (num.value === "" ? undefined : Number(num.value)) };
    }
    const text = h("input", { name, required: required.has(name), maxlength: s.maxLength, minlength: s.minLength, value: s.default ?? "" });
    if (typeof s.pattern === "string") {
      // JSON Schema patterns are ECMA-262 regexes, unanchored: checked here, not by the HTML pattern attribute.
      const re = new RegExp(s.pattern, "u");
      const check = () => text.setCustomValidity(text.value === "" || re.test(text.value) ? "" : `must match ${s.pattern}`);
      text.addEventListener("input", check);
      check();
    }
    return { name, el: field(label, text, help), read: () => (text.value === "" ? undefined : text.value) };
  });
}

export async function deployWizard(main: HTMLElement, [slug]: string[], ctx: Context): Promise<void> {
  if (!ctx.project) {
    main.append(h("p", { class: "empty" }, "Select a project first."));
    return;
  }
  const pid = ctx.project.project_id;
  const [versions, allocs] = await Promise.all([get<Obj[]>(`${C}/apps/${slug}`, { tenant_id: ctx.project.tenant_id }), activeAllocations(ctx)]);
  const usable = versions.filter((v) => v.active && !v.deprecated);
  const manifest = usable[0] ?? versions[0];
  main.append(h("h1", null, `Deploy ${manifest?.display_name ?? slug}`));
  if (!manifest) {
    main.append(h("p", { class: "empty" }, "This app has no version you can deploy."));
    return;
  }
  const steps = ["Basics", "Configuration", "Placement", "Review"];
  let step = 0;
  const progress = h("ol", { class: "steps", "aria-label": "Deploy steps" });
  const name = h("input", { name: "instance_name", required: true, maxlength: 100, value: `${slug}-1` });
  const version = h("select", { name: "app_version" }, usable.map((v) => h("option", { value: v.version }, `${v.version}${v.runtime_version ? ` (runtime ${v.runtime_version})` : ""}`)));
  const controls = inputControls(manifest.inputs ?? {});
  // Launchable apps (e.g. JupyterLab) get an allocation of their own at deploy: the placement asks for its
  // GPUs instead of existing allocations.
  const launchable = manifest.artifact_kind === "launchable";
  const mode = h("select", { name: "mode" }, h("option", { value: "same_node" }, "same node"), h("option", { value: "split" }, "split over allocations"));
  const launchModel = h("input", { name: "gpu_model", required: launchable, value: "H100-80GB", list: "deploy-gpu-models" });
  const launchCount = h("input", { name: "gpu_count", type: "number", min: 1, max: 64, value: 1, required: launchable });
  // What the instance runs: the app's image (digest-pinned) and what it installs, before anything is deployed.
  const runtimeFacts = (m: Obj): HTMLElement =>
    h(
      "dl",
      { class: "facts", id: "deploy-runtime" },
      h("dt", null, "Runtime image"),
      h("dd", { id: "deploy-runtime-image" }, h("code", null, m.runtime_profile?.image ?? m.artifact_ref ?? "—")),
      h("dt", null, "Runtime"),
      h("dd", { id: "deploy-runtime-version" }, m.runtime_version ?? "—"),
      h("dt", null, "Kind"),
      h("dd", null, launchable ? "launchable (opens in the browser)" : m.artifact_kind),
    );
  const runtimeBox = h("div", null, runtimeFacts(manifest));
  const allocLabel = (a: Obj) => `${a.name} (${a.gpu_count} × ${a.gpu_model})`;
  const controller = h("select", { name: "controller_allocation", required: true }, allocs.map((a) => h("option", { value: a.allocation_id }, allocLabel(a))));
  const workerBoxes = allocs.map((a) => h("label", { class: "inline" }, h("input", { type: "checkbox", name: "worker", value: a.allocation_id }), ` ${allocLabel(a)}`));
  const review = h("div", { class: "review" });
  const err = h("p", { class: "error", role: "alert", hidden: true });
  const roles: Obj[] = manifest.roles ?? [];
  const panes = [
    h("fieldset", null, h("legend", null, "Basics"), field("Instance name", name), field("Version", version, "App version and, separately, the runtime it installs."), runtimeBox),
    h(
      "fieldset",
      null,
      h("legend", null, "Configuration"),
      controls.length ? controls.map((c) => c.el) : h("p", { class: "muted" }, "This app asks for no configuration."),
    ),
    launchable
      ? h(
          "fieldset",
          null,
          h("legend", null, "Placement"),
          h("p", { class: "help" }, "A new allocation is created for this app, from its image."),
          field("GPU model", launchModel),
          h("datalist", { id: "deploy-gpu-models" }, ["H100-80GB", "A100-80GB", "L40S-48GB"].map((m) => h("option", { value: m }))),
          field("GPUs", launchCount),
        )
      : h(
          "fieldset",
          null,
          h("legend", null, "Placement"),
          allocs.length ? null : h("p", { class: "error", role: "alert" }, "You need an active allocation: create one first."),
          field("Mode", mode),
          field(`${roles[0]?.key ?? "Controller"} allocation`, controller),
          h("fieldset", null, h("legend", null, `${roles[1]?.key ?? "Worker"} allocations (optional)`), workerBoxes),
        ),
    h("fieldset", null, h("legend", null, "Review"), review),
  ];
  const back = h("button", { type: "button", class: "secondary" }, "Back");
  const next = h("button", { type: "submit", class: "primary" }, "Next");
  const body = (): Obj => {
    const config: Obj = {};
    for (const c of controls) {
      const v = c.read();
      if (v !== undefined) config[c.name] = v;
    }
    return {
      name: name.value,
      app_slug: slug,
      app_version: version.value || null,
      config,
      placement_intent: launchable
        ? { mode: "launch", gpu_model: launchModel.value, gpu_count: Number(launchCount.value) }
        : {
            mode: mode.value,
            controller_allocation_id: controller.value || null,
            worker_allocation_ids: [...main.querySelectorAll<HTMLInputElement>("input[name=worker]:checked")].map((i) => i.value),
          },
    };
  };
  const show = () => {
    panes.forEach((p, i) => (p.hidden = i !== step));
    clear(progress, steps.map((s, i) => h("li", { "aria-current": i === step ? "step" : null }, s)));
    back.hidden = step === 0;
    next.textContent = step === steps.length - 1 ? "Deploy" : "Next";
    if (step === steps.length - 1) clear(review, h("pre", null, JSON.stringify(body(), null, 2)));
    panes[step].querySelector<HTMLElement>("input, select")?.focus();
  };
  back.addEventListener("click", () => {
    step = Math.max(0, step - 1);
    show();
  });
  version.addEventListener("change", () => {
    const chosen = usable.find((v) => v.version === version.value);
    if (chosen) clear(runtimeBox, runtimeFacts(chosen));
  });
  const form = h(
    "form",
    {
      class: "card wizard",
      novalidate: true,
      onsubmit: async (e: Event) => {
        e.preventDefault();
        err.hidden = true;
        const invalid = [...panes[step].querySelectorAll<HTMLInputElement>("input, select")].find((i) => !i.checkValidity());
        if (invalid) {
          invalid.setAttribute("aria-invalid", "true");
          err.textContent = `${invalid.labels?.[0]?.textContent ?? invalid.name}: ${invalid.validationMessage}`;
          err.hidden = false;
          invalid.focus();
          return;
        }
        if (step < steps.length - 1) {
          step += 1;
          show();
          return;
        }
        next.disabled = true;
        try {
          const inst = await post<Obj>(`${R}/projects/${pid}/instances`, body());
          go(`/instances/${inst.instance_id}`);
        } catch (ex) {
          err.textContent = describe(ex);
          err.hidden = false;
        } finally {
          next.disabled = false;
        }
      },
    },
    progress,
    panes,
    err,
    h("div", { class: "actions" }, back, next),
  );
  main.append(form);
  show();
}

export async function instanceList(main: HTMLElement, _p: string[], ctx: Context): Promise<void> {
  main.append(h("h1", null, "App instances"));
  if (!ctx.project) return;
  const page = await get<Obj>(`${R}/instances`, { project_id: ctx.project.project_id });
  main.append(
    table(
      ["Name", "App", "Version", "Status", "Created"],
      (page.items as Obj[]).map((i) => [h("a", { href: `#/instances/${i.instance_id}` }, i.name), i.app_slug, i.app_version, badge(i.status), when(i.created_at)]),
    ),
  );
}

export async function instanceDetail(main: HTMLElement, [id]: string[], ctx: Context): Promise<Cleanup> {
  let inst = await get<Obj>(`${R}/instances/${id}`);
  let manifestRoles: Obj[] = [];
  try {
    manifestRoles = (await get<Obj>(`${C}/manifests/${inst.manifest_id}`)).roles ?? [];
  } catch {
    manifestRoles = [];
  }
  const workerKey = manifestRoles[1]?.key ?? manifestRoles[0]?.key ?? "worker";
  const header = h("div", { class: "title-row" });
  const facts = h("section", { "aria-labelledby": "h-inst" });
  const membersBox = h("section", { "aria-labelledby": "h-members" });
  const opsBox = h("section", { "aria-labelledby": "h-ops" });
  const access = h("section", { "aria-labelledby": "h-access" });
  const events = h("ol", { class: "timeline", id: "instance-events", "aria-live": "polite", "aria-label": "Instance events" });
  const notice = h("p", { role: "status", class: "notice", "aria-live": "polite" });
  const seen = new Set<number>();

  // Launchable apps open in the browser through the gateway (/apps/{id}/): the access token goes in the
  // URL once, the gateway trades it for a cookie scoped to the app and drops it from the address.
  const openBox = h("span", { class: "inline" });
  const paint = () => {
    clear(header, h("h1", null, inst.name), badge(inst.status));
    const workload = inst.runtime_detail?.workload;
    clear(
      openBox,
      workload && inst.status === "running"
        ? h(
            "button",
            {
              type: "button",
              class: "primary",
              id: "open-app",
              "data-open-path": workload.open_path ?? `/apps/${id}/`,
              onclick: async () => {
                const path = workload.open_path ?? `/apps/${id}/`;
                window.open(`${path}?access_token=${encodeURIComponent(await token())}`, "_blank", "noopener");
              },
            },
            `Open ${inst.app_slug}`,
          )
        : workload
          ? h("span", { class: "muted", id: "open-app-waiting" }, `Opens once running (${inst.status})`)
          : null,
    );
    clear(
      facts,
      h("h2", { id: "h-inst" }, "Overview"),
      inst.failure_reason ? h("p", { class: "error", role: "alert" }, `Failure reason: ${inst.failure_reason}`) : null,
      h(
        "dl",
        { class: "facts" },
        h("dt", null, "Status"),
        h("dd", { id: "instance-status" }, inst.status),
        h("dt", null, "App"),
        h("dd", null, `${inst.app_slug} ${inst.app_version}`),
        h("dt", null, "Digest"),
        h("dd", null, h("code", null, inst.artifact_digest)),
        h("dt", null, "Health"),
        h("dd", null, inst.health?.status ?? "—", inst.health?.message ? ` · ${inst.health.message}` : ""),
        h("dt", null, "Configuration"),
        h("dd", null, h("code", null, JSON.stringify(inst.config))),
      ),
      inst.decommission ? h("details", null, h("summary", null, "Decommission report"), h("pre", null, JSON.stringify(inst.decommission, null, 2))) : null,
    );
  };

  const act = async (what: string, fn: () => Promise<unknown>) => {
    notice.textContent = `${what}…`;
    try {
      await fn();
      notice.textContent = `${what}: requested.`;
      await refresh();
    } catch (ex) {
      notice.textContent = `${what} failed: ${describe(ex)}`;
    }
  };

  const refresh = async () => {
    inst = await get<Obj>(`${R}/instances/${id}`);
    paint();
    const [members, ops, allocs] = await Promise.all([
      get<Obj>(`${R}/instances/${id}/members`, { include_tombstones: true }),
      get<Obj>(`${R}/instances/${id}/operations`),
      activeAllocations(ctx),
    ]);
    const live = inst.status !== "decommissioned";
    const used = new Set((members.items as Obj[]).filter((m) => !m.tombstoned).map((m) => m.allocation_id));
    const free = allocs.filter((a) => !used.has(a.allocation_id));
    const addSel = h("select", { "aria-label": "Allocation for the new worker" }, free.map((a) => h("option", { value: a.allocation_id }, `${a.name} (${a.gpu_count} × ${a.gpu_model})`)));
    clear(
      membersBox,
      h("h2", { id: "h-members" }, "Members"),
      table(
        ["Component", "Allocation", "Status", "Detail", ""],
        (members.items as Obj[]).map((m) => [
          m.component_key,
          h("a", { href: `#/allocations/${m.allocation_id}` }, m.allocation_id.slice(0, 8)),
          [badge(m.status), m.tombstoned ? ` tombstone: ${m.tombstone_reason ?? ""}` : ""],
          h("code", null, JSON.stringify(m.detail ?? {})),
          !m.tombstoned && live
            ? h(
                "span",
                { class: "inline" },
                h("button", { type: "button", class: "secondary", onclick: () => act("Drain", () => post(`${R}/instances/${id}/operations`, { kind: "drain", member_id: m.member_id })) }, "Drain"),
                h("button", { type: "button", class: "secondary", onclick: () => act("Remove", () => post(`${R}/instances/${id}/operations`, { kind: "remove", member_id: m.member_id })) }, "Remove"),
              )
            : "",
        ]),
      ),
      live && free.length
        ? h(
            "div",
            { class: "inline" },
            addSel,
            h("button", { type: "button", onclick: () => act("Add worker", () => post(`${R}/instances/${id}/operations`, { kind: "add", allocation_id: addSel.value, component_key: workerKey })) }, "Add worker"),
          )
        : null,
    );
    clear(
      opsBox,
      h("h2", { id: "h-ops" }, "Operations"),
      table(
        ["Kind", "Component", "Status", "Progress", "Error", "Updated", ""],
        (ops.items as Obj[]).map((o) => [
          o.kind,
          o.component_key ?? "—",
          badge(o.status),
          `${o.progress_message ?? ""}${o.progress_percent != null ? ` (${o.progress_percent}%)` : ""}`,
          o.error ?? "",
          when(o.updated_at),
          opActions(o),
        ]),
      ),
    );
  };

  // Recovery of stuck operations (project admins, operators): retry a failed one, cancel one not yet
  // running, force-fail one whose controller went silent. Each is audited with the reason given.
  const opActions = (o: Obj): HTMLElement | string => {
    const button = (label: string, path: string) =>
      h("button", { type: "button", class: "secondary", onclick: () => act(`${label} operation`, () => post(`${R}/operations/${o.operation_id}/${path}`, { reason: `${label.toLowerCase()} from the web console` })) }, label);
    const buttons = [
      o.status === "failed" ? button("Retry", "retry") : null,
      ["pending", "claimed"].includes(o.status) ? button("Cancel", "cancel") : null,
      ["claimed", "in_progress"].includes(o.status) ? button("Force-fail", "force-fail") : null,
    ].filter((b): b is HTMLButtonElement => b !== null);
    return buttons.length ? h("span", { class: "inline" }, buttons) : "";
  };

  const loadAccess = async () => {
    try {
      const cred = await get<Obj>(`${R}/instances/${id}/credential`);
      clear(
        access,
        h("h2", { id: "h-access" }, "Access bundle"),
        h("p", { class: "help" }, "The instance's controller holds the private key; its public key is installed on the member allocations."),
        h(
          "dl",
          { class: "facts" },
          h("dt", null, "Fingerprint"),
          h("dd", null, h("code", null, cred.fingerprint)),
          h("dt", null, "Custody"),
          h("dd", null, cred.custody),
          h("dt", null, "Status"),
          h("dd", null, cred.status),
          h("dt", null, "Allocations"),
          h("dd", null, (cred.allocation_ids ?? []).map((a: string) => h("a", { href: `#/allocations/${a}` }, `${a.slice(0, 8)} `))),
        ),
        h("details", null, h("summary", null, "Public key"), h("pre", null, cred.public_key)),
        h("button", { type: "button", class: "secondary", onclick: () => act("Rotate credential", async () => { await post(`${R}/instances/${id}/credential/rotate`, {}); await loadAccess(); }) }, "Rotate"),
      );
    } catch (ex) {
      clear(access, h("h2", { id: "h-access" }, "Access bundle"), h("p", { class: "muted" }, describe(ex)));
    }
  };

  let confirming = false;
  const decommission = h("button", { type: "button", class: "danger", id: "decommission" }, "Decommission");
  decommission.addEventListener("click", () => {
    if (!confirming) {
      confirming = true;
      decommission.textContent = "Confirm decommission";
      return;
    }
    void act("Decommission", () => post(`${R}/instances/${id}/decommission`, { reason: "decommissioned from the web console" }));
  });
  clear(
    main,
    header,
    h("div", { class: "actions" }, openBox, decommission),
    notice,
    facts,
    membersBox,
    opsBox,
    h("section", { "aria-labelledby": "h-events" }, h("h2", { id: "h-events" }, "Events (live)"), events),
    access,
  );
  paint();
  await refresh();
  void loadAccess();

  const stop = new AbortController();
  let pending: number | undefined;
  streamEvents(
    `${R}/instances/${id}/events/stream`,
    (_name, data) => {
      const e = JSON.parse(data) as Obj;
      if (seen.has(e.seq)) return;
      seen.add(e.seq);
      events.append(h("li", { "data-kind": e.kind }, h("span", { class: "phase" }, e.kind), ` ${e.message} `, h("time", { datetime: e.occurred_at }, when(e.occurred_at))));
      window.clearTimeout(pending);
      pending = window.setTimeout(() => void refresh().catch(() => null), 200);
    },
    stop.signal,
  );
  const poll = window.setInterval(() => void refresh().catch(() => null), 3000);
  return () => {
    stop.abort();
    window.clearInterval(poll);
    window.clearTimeout(pending);
  };
}

/** `#/instances/{id}/reopen?path=/apps/{id}/...`: where the gateway sends an app page whose admission cookie
 * expired. A fresh token from this console session (refreshed if need be), then back to that page, which
 * trades it for a new cookie. Only ever back into this app: a path outside `/apps/{id}/` (or another origin)
 * opens the app's start page instead (no open redirect). */
export async function reopenApp(main: HTMLElement, [id]: string[]): Promise<void> {
  const base = `/apps/${id}/`;
  const wanted = new URL(new URLSearchParams(location.hash.split("?")[1] ?? "").get("path") ?? base, location.origin);
  const target = wanted.origin === location.origin && wanted.pathname.startsWith(base) ? wanted : new URL(base, location.origin);
  main.append(h("h1", null, "Reopening the app"), h("p", { role: "status" }, "Your app session ended; signing you back in…"));
  target.searchParams.set("access_token", await token());
  location.replace(target.pathname + target.search);
}
