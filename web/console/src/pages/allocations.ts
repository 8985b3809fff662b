import { describe, del, get, post, token } from "../api";
import { canReadBilling, type Context, type Obj } from "../context";
import { badge, clear, field, h, table, when, type Child } from "../dom";
import { go, type Cleanup } from "../nav";
import { preemptionReasonText, reasonText, span } from "../queueing";

const A = "/api/allocations";

function needProject(main: HTMLElement, ctx: Context): boolean {
  if (ctx.project) return true;
  main.append(h("p", { class: "empty" }, "You are not a member of any project yet: ask a tenant admin to add you."));
  return false;
}

export async function allocationList(main: HTMLElement, _p: string[], ctx: Context): Promise<void> {
  main.append(
    h("div", { class: "title-row" }, h("h1", null, "Allocations"), ctx.project ? h("a", { class: "button primary", href: "#/allocations/new" }, "New allocation") : null),
  );
  if (!needProject(main, ctx)) return;
  const showReleased = h("input", { type: "checkbox", id: "show-released" });
  const list = h("div", { "aria-live": "polite" });
  const load = async () => {
    const rows = await get<Obj[]>(`${A}/projects/${ctx.project!.project_id}/allocations`, { include_released: showReleased.checked });
    clear(
      list,
      table(
        ["Name", "Status", "GPUs", "Shape", "Runtime", "Host class", "Requested"],
        rows.map((a) => [
          h("a", { href: `#/allocations/${a.allocation_id}` }, a.name || a.allocation_id),
          [
            badge(a.status),
            a.failure_reason ? h("span", { class: "reason" }, ` ${a.failure_reason}`) : null,
            a.status === "queued" ? h("span", { class: "reason" }, ` position ${a.queue_position ?? "—"}: ${reasonText(a.pending_reason)}`) : null,
            a.pending_resize_gpus ? h("span", { class: "reason" }, ` resize to ${a.pending_resize_gpus} waits: ${reasonText(a.pending_resize_reason)}`) : null,
            a.preemption ? h("span", { class: "reason warning" }, ` preemption at ${when(a.preemption.deadline)}`) : null,
          ],
          `${a.gpu_count} × ${a.gpu_model}`,
          a.shape,
          a.runtime ? `${a.runtime.slug} ${a.runtime.version}` : a.driver === "process" ? "process" : "—",
          a.host_class ?? "any",
          when(a.requested_at),
        ]),
        `Allocations of ${ctx.project!.name}`,
      ),
    );
  };
  showReleased.addEventListener("change", () => void load());
  main.append(h("label", { class: "inline" }, showReleased, " Show released"), list);
  await load();
}

export async function allocationNew(main: HTMLElement, _p: string[], ctx: Context): Promise<void> {
  main.append(h("h1", null, "New allocation"));
  if (!needProject(main, ctx)) return;
  const pid = ctx.project!.project_id;
  const [volumes, keys, runtimes] = await Promise.all([
    get<Obj[]>(`${A}/projects/${pid}/volumes`).catch(() => [] as Obj[]),
    get<Obj[]>(`${A}/ssh-keys`).catch(() => [] as Obj[]),
    runtimeChoices(pid),
  ]);
  const name = h("input", { name: "name", required: true, maxlength: 100, value: "workspace" });
  const shape = h("select", { name: "shape" }, h("option", { value: "gpu_slice" }, "GPU slice (some GPUs of a host)"), h("option", { value: "baremetal" }, "Bare metal (a whole host)"));
  const model = h("input", { name: "gpu_model", required: true, value: "H100-80GB", list: "gpu-models" });
  const count = h("input", { name: "gpu_count", type: "number", min: 1, max: 64, value: 1, required: true });
  const hostClass = h("input", { name: "host_class", maxlength: 64, placeholder: "any" });
  // Runtime: the host class's default (else the platform's), an active runtime of the catalog, or any
  // reference the API takes (slug, slug@version, sha256:<digest>) typed in.
  const runtime = h(
    "select",
    { name: "runtime", id: "runtime" },
    h("option", { value: "" }, "Default (the host class's, else the platform's)"),
    runtimes.map((r) => h("option", { value: `${r.slug}@${r.version}`, "data-digest": r.digest }, `${r.display_name || r.slug} ${r.version}${r.state === "canary" ? " (canary)" : ""}`)),
    h("option", { value: OTHER_RUNTIME }, "Other (slug, slug@version or sha256:…)"),
  );
  const runtimeRef = h("input", { name: "runtime_ref", maxlength: 200, placeholder: "gpuaas-base@1.0.0 or sha256:…" });
  const runtimeRefField = field("Runtime reference", runtimeRef);
  runtimeRefField.hidden = true;
  const runtimeDigest = h("p", { class: "help", id: "runtime-digest" });
  const showRuntime = () => {
    runtimeRefField.hidden = runtime.value !== OTHER_RUNTIME;
    const digest = runtime.selectedOptions[0]?.dataset.digest;
    runtimeDigest.textContent = digest ? `Pinned by digest: ${digest}` : "";
  };
  runtime.addEventListener("change", showRuntime);
  const volumeBoxes = volumes
    .filter((v) => v.status !== "deleted")
    .map((v) => h("label", { class: "inline" }, h("input", { type: "checkbox", name: "volume", value: v.volume_id }), ` ${v.name} (${v.size_gb} GB, ${v.access_mode})`));
  const err = h("p", { class: "error", role: "alert", hidden: true });
  const submit = h("button", { type: "submit", class: "primary" }, "Create allocation");
  shape.addEventListener("change", () => {
    count.disabled = shape.value === "baremetal";
  });
  const form = h(
    "form",
    {
      class: "card",
      onsubmit: async (e: Event) => {
        e.preventDefault();
        err.hidden = true;
        submit.disabled = true;
        try {
          const body: Obj = {
            name: name.value,
            shape: shape.value,
            gpu_model: model.value,
            gpu_count: shape.value === "baremetal" ? null : Number(count.value),
            host_class: hostClass.value || null,
            volume_ids: [...form.querySelectorAll<HTMLInputElement>("input[name=volume]:checked")].map((i) => i.value),
          };
          const chosen = runtime.value === OTHER_RUNTIME ? runtimeRef.value.trim() : runtime.value;
          if (chosen) body.runtime = chosen; // left out: the default applies (and older platforms accept the body)
          const a = await post<Obj>(`${A}/projects/${pid}/allocations`, body);
          go(`/allocations/${a.allocation_id}`);
        } catch (ex) {
          err.textContent = describe(ex);
          err.hidden = false;
        } finally {
          submit.disabled = false;
        }
      },
    },
    field("Name", name),
    field("Shape", shape),
    field("GPU model", model, "The GPU model to place on, e.g. H100-80GB."),
    h("datalist", { id: "gpu-models" }, ["H100-80GB", "A100-80GB", "L40S"].map((m) => h("option", { value: m }))),
    field("GPUs", count, "Ignored for bare metal: the whole host is yours."),
    field("Host class", hostClass, "Optional: pin a class of hosts."),
    field("Runtime image", runtime, "The image your allocation's container runs, pinned by digest. Hosts without containers (process driver) run none."),
    runtimeRefField,
    runtimeDigest,
    h(
      "fieldset",
      null,
      h("legend", null, "Volumes"),
      volumeBoxes.length ? volumeBoxes : h("p", { class: "muted" }, "No volumes in this project. ", h("a", { href: "#/keys" }, "Create one")),
    ),
    h(
      "fieldset",
      null,
      h("legend", null, "SSH keys"),
      keys.length
        ? h("ul", null, keys.map((k) => h("li", null, `${k.name} `, h("code", null, k.fingerprint))))
        : h("p", { class: "muted" }, "You have no SSH key yet: the browser terminal still works. ", h("a", { href: "#/keys" }, "Add a key")),
      h("p", { class: "help" }, "Your personal keys are installed on the allocation; grant others access on its page."),
    ),
    err,
    submit,
  );
  main.append(form);
  name.focus();
}

const ACTIVE_ACTIONS = new Set(["active"]);
const OTHER_RUNTIME = "__other__";

/** Runtime images a new allocation of the project may run (active catalog `runtime` apps, and canaries
 * offered to its tenant), newest version first per slug, each pinned by digest. */
async function runtimeChoices(projectId: string): Promise<Obj[]> {
  return get<Obj[]>(`${A}/runtimes`, { project_id: projectId }).catch(() => [] as Obj[]);
}

/** What the allocation runs in: its runtime image (pinned by digest), the host's driver, its limits. */
function isolationFacts(alloc: Obj): Child[] {
  const rt = alloc.runtime;
  const lim = alloc.limits;
  const ev = alloc.release_evidence;
  return [
    h("dt", null, "Runtime"),
    h("dd", { id: "alloc-runtime" }, rt ? `${rt.slug} ${rt.version}` : alloc.driver === "process" ? "none (process driver)" : "—"),
    h("dt", null, "Image digest"),
    h("dd", { id: "alloc-runtime-digest" }, rt?.digest ? h("code", { title: rt.image ?? "" }, rt.digest) : "—"),
    h("dt", null, "Driver"),
    h("dd", { id: "alloc-driver" }, alloc.driver ?? "—"),
    h("dt", null, "Limits"),
    h("dd", { id: "alloc-limits" }, lim ? `${lim.cpus} CPUs, ${lim.memory_mb} MB memory, ${lim.pids} processes` : "—"),
    ev ? [h("dt", null, "Release checked"), h("dd", { id: "alloc-release-evidence" }, releaseChecks(ev))] : null,
  ];
}

/** Seconds until `iso` (negative once past). */
function secondsUntil(iso: string): number {
  return (new Date(iso).getTime() - Date.now()) / 1000;
}

/** When a queued request gives up: `max_wait_s` after it entered the queue (`status_changed_at`). */
function givesUpAt(alloc: Obj): string | null {
  if (alloc.status !== "queued" || !alloc.max_wait_s) return null;
  return new Date(new Date(alloc.status_changed_at).getTime() + alloc.max_wait_s * 1000).toISOString();
}

/** A queued request: its place in its project's queue, why it waits and when it gives up (issue 29). */
function queueNotice(alloc: Obj): HTMLElement | null {
  if (alloc.status !== "queued") return null;
  const until = givesUpAt(alloc);
  return h(
    "div",
    { class: "queue-notice", id: "alloc-queue", role: "status", "data-position": alloc.queue_position ?? "", "data-reason": alloc.pending_reason ?? "" },
    h(
      "p",
      null,
      h("strong", null, `Waiting in the ${alloc.gpu_model} queue`),
      alloc.queue_position ? [": position ", h("span", { id: "alloc-queue-position" }, String(alloc.queue_position)), " in the project's queue"] : null,
      ". Why: ",
      h("span", { id: "alloc-pending-reason", "data-reason": alloc.pending_reason ?? "" }, reasonText(alloc.pending_reason)),
      ".",
    ),
    h(
      "p",
      { class: "muted", id: "alloc-max-wait", "data-until": until ?? "" },
      until
        ? [`Gives up (fails) after waiting ${span(alloc.max_wait_s)}: in `, h("span", { class: "countdown", "data-until": until }, span(secondsUntil(until))), ` (${when(until)}).`]
        : "No maximum wait: it waits until GPUs free up or it is cancelled.",
    ),
    alloc.estimated_start_at
      ? h("p", { class: "muted", id: "alloc-estimated-start" }, `Estimated start: ${when(alloc.estimated_start_at)} (when the GPUs reclaimed for it are free).`)
      : null,
  );
}

/** A resize up that waits for GPUs while the allocation runs on (issue 29): the size asked, why, since when,
 * and a button to cancel it (nothing was reserved for it). */
function pendingResizeNotice(alloc: Obj, cancel: () => void): HTMLElement | null {
  if (!alloc.pending_resize_gpus) return null;
  return h(
    "div",
    { class: "queue-notice", id: "alloc-pending-resize", role: "status", "data-gpus": alloc.pending_resize_gpus, "data-reason": alloc.pending_resize_reason ?? "" },
    h(
      "p",
      null,
      h("strong", null, `Resize to ${alloc.pending_resize_gpus} GPUs waits in the ${alloc.gpu_model} queue`),
      ". Why: ",
      h("span", { id: "alloc-pending-resize-reason", "data-reason": alloc.pending_resize_reason ?? "" }, reasonText(alloc.pending_resize_reason)),
      alloc.pending_resize_since ? [". Waiting since ", h("span", { id: "alloc-pending-resize-since" }, when(alloc.pending_resize_since))] : null,
      ".",
    ),
    h(
      "p",
      { class: "muted" },
      `It keeps running on its ${alloc.gpu_count} GPU${alloc.gpu_count === 1 ? "" : "s"} until the GPUs are granted. `,
      h("button", { type: "button", id: "cancel-resize", class: "secondary", onclick: cancel }, "Cancel resize"),
    ),
  );
}

/** A preemption scheduled for this allocation: when it stops, why, and what happens to it then (issue 29). */
function preemptionNotice(alloc: Obj): HTMLElement | null {
  const p = alloc.preemption;
  if (!p) return null;
  return h(
    "div",
    { class: "preemption-notice", id: "alloc-preemption", role: "alert", "data-deadline": p.deadline, "data-reason": p.reason },
    h(
      "p",
      null,
      h("strong", null, "Preemption scheduled: "),
      "this allocation stops in ",
      h("span", { class: "countdown", id: "alloc-preemption-countdown", "data-until": p.deadline }, span(secondsUntil(p.deadline))),
      ` (at ${when(p.deadline)}), because ${preemptionReasonText(p.reason)}.`,
    ),
    h(
      "p",
      { class: "muted" },
      "Save your work: at the deadline it gets SIGTERM, then SIGKILL. ",
      p.on_preemption === "requeue" ? "It then waits in the queue again (with its original age)." : "It is then released.",
      " The notice is also in /run/gpuaas/preemption inside it and on its SSH sessions.",
    ),
  );
}

/** The host agent's release evidence: each check it made and whether it held. */
function releaseChecks(ev: Obj): HTMLElement {
  const checks = Object.entries(ev).filter(([, v]) => typeof v === "boolean");
  return h(
    "ul",
    { class: "checks" },
    checks.map(([k, v]) => h("li", { "data-check": k, "data-ok": String(v) }, `${v ? "✓" : "✗"} ${k.replace(/_/g, " ")}`)),
    Array.isArray(ev.checked) && ev.checked.length ? h("li", { class: "muted" }, `checked: ${ev.checked.join(", ")}`) : null,
  );
}

export async function allocationDetail(main: HTMLElement, [id]: string[], ctx: Context): Promise<Cleanup> {
  let alloc = await get<Obj>(`${A}/allocations/${id}`);
  const header = h("div", { class: "title-row" });
  const overview = h("section", { "aria-labelledby": "h-overview", id: "overview" });
  const actions = h("div", { class: "actions", role: "group", "aria-label": "Actions" });
  const notice = h("p", { role: "status", class: "notice", "aria-live": "polite" });
  const sshSection = h("section", { "aria-labelledby": "h-ssh", id: "ssh" });
  const storage = h("section", { "aria-labelledby": "h-storage", id: "storage" });
  const timelineList = h("ol", { class: "timeline", id: "timeline", "aria-live": "polite", "aria-label": "Activity timeline" });
  const metrics = h("section", { "aria-labelledby": "h-metrics", id: "metrics" });
  const seen = new Set<number>();
  let confirmingRelease = false;
  let resizeWanted: string | null = null; // what the user typed survives live repaints

  const act = async (what: string, path: string, body?: Obj) => {
    notice.textContent = `${what}…`;
    try {
      alloc = await post<Obj>(`${A}/allocations/${id}/${path}`, body);
      notice.textContent = `${what}: requested.`;
      paint();
    } catch (ex) {
      notice.textContent = `${what} failed: ${describe(ex)}`;
    }
  };

  const cancelResize = async () => {
    notice.textContent = "Cancel resize…";
    try {
      alloc = await del<Obj>(`${A}/allocations/${id}/resize`);
      notice.textContent = "Cancel resize: done.";
      paint();
    } catch (ex) {
      notice.textContent = `Cancel resize failed: ${describe(ex)}`;
    }
  };

  const paint = () => {
    clear(header, h("h1", null, alloc.name || "Allocation"), badge(alloc.status));
    const ep = alloc.ssh_endpoint;
    clear(
      overview,
      h("h2", { id: "h-overview" }, "Overview"),
      alloc.failure_reason ? h("p", { class: "error", role: "alert" }, `Failure reason: ${alloc.failure_reason}`) : null,
      alloc.attention ? h("p", { class: "warning", role: "alert" }, `Attention: ${alloc.attention}`) : null,
      queueNotice(alloc),
      pendingResizeNotice(alloc, () => void cancelResize()),
      preemptionNotice(alloc),
      h(
        "dl",
        { class: "facts" },
        h("dt", null, "Status"),
        h("dd", { id: "alloc-status" }, alloc.status),
        h("dt", null, "GPUs"),
        h(
          "dd",
          { id: "alloc-gpus" },
          `${alloc.gpu_count} × ${alloc.gpu_model} (${alloc.shape})`,
          alloc.target_gpu_count ? ` → ${alloc.target_gpu_count}` : "",
          alloc.pending_resize_gpus ? ` (→ ${alloc.pending_resize_gpus} waits)` : "",
        ),
        alloc.status === "queued"
          ? [
              h("dt", null, "Queue position"),
              h("dd", { id: "alloc-position" }, alloc.queue_position ?? "—"),
              h("dt", null, "Pending reason"),
              h("dd", { id: "alloc-reason", "data-reason": alloc.pending_reason ?? "" }, reasonText(alloc.pending_reason)),
              h("dt", null, "Max wait"),
              h("dd", null, alloc.max_wait_s ? span(alloc.max_wait_s) : "none"),
            ]
          : null,
        alloc.priority ? [h("dt", null, "Priority"), h("dd", null, String(alloc.priority))] : null,
        h("dt", null, "GPU indices"),
        h("dd", null, (alloc.gpu_indices ?? []).join(", ") || "—"),
        isolationFacts(alloc),
        h("dt", null, "SSH"),
        h("dd", null, ep ? h("code", null, `ssh -p ${ep.port} ${ep.username}@${ep.host}`) : "not yet"),
        h("dt", null, "Requested"),
        h("dd", null, when(alloc.requested_at)),
        h("dt", null, "Active since"),
        h("dd", null, when(alloc.activated_at)),
        h("dt", null, "After release"),
        h("dd", null, alloc.after_release ?? "—"),
      ),
    );
    const resizeInput = h("input", { type: "number", min: 1, max: 64, value: resizeWanted ?? alloc.gpu_count, "aria-label": "New GPU count", class: "small" });
    resizeInput.addEventListener("input", () => { resizeWanted = resizeInput.value; });
    // The confirmation outlives repaints (live updates redraw the actions while the user decides).
    const releaseLabel = alloc.status === "queued" ? "Cancel request" : "Release";
    const release = h("button", { type: "button", class: "danger", id: "release" }, confirmingRelease ? `Confirm ${releaseLabel.toLowerCase()}` : releaseLabel);
    release.addEventListener("click", () => {
      if (!confirmingRelease) {
        confirmingRelease = true;
        release.textContent = `Confirm ${releaseLabel.toLowerCase()}`;
        return;
      }
      confirmingRelease = false;
      void act(releaseLabel, "release");
    });
    clear(
      actions,
      ACTIVE_ACTIONS.has(alloc.status) ? h("a", { class: "button", href: `#/allocations/${id}/terminal` }, "Open terminal") : null,
      ACTIVE_ACTIONS.has(alloc.status) ? h("button", { type: "button", onclick: () => act("Restart", "restart") }, "Restart") : null,
      ACTIVE_ACTIONS.has(alloc.status) && alloc.shape === "gpu_slice"
        ? h("span", { class: "inline" }, resizeInput, h("button", { type: "button", onclick: () => { resizeWanted = null; void act("Resize", "resize", { gpu_count: Number(resizeInput.value) }); } }, "Resize"))
        : null,
      ["active", "failed", "provisioning", "requested", "queued"].includes(alloc.status) ? release : null,
      alloc.status === "release_failed" ? h("button", { type: "button", class: "danger", onclick: () => act("Retry release", "retry-release") }, "Retry release") : null,
    );
  };

  const loadSsh = async () => {
    const [keys, grants, members] = await Promise.all([
      get<Obj[]>(`${A}/ssh-keys`).catch(() => [] as Obj[]),
      get<Obj[]>(`${A}/allocations/${id}/ssh-grants`).catch(() => [] as Obj[]),
      get<Obj[]>(`/api/identity/projects/${alloc.project_id}/members`).catch(() => [] as Obj[]),
    ]);
    // The member picker: the project's members by name and email (one entry per person), not a raw id.
    const people = new Map<string, Obj>();
    for (const m of members) if (!people.has(String(m.user_id))) people.set(String(m.user_id), m);
    const label = (m: Obj) => (m.display_name ? `${m.display_name} <${m.email}>` : m.email ?? String(m.user_id));
    const who = (userId: string | null) => (userId && people.has(userId) ? label(people.get(userId)!) : userId ?? "—");
    const user = h(
      "select",
      { name: "user_id", required: true },
      h("option", { value: "" }, "Choose a member…"),
      [...people.values()].sort((a, b) => label(a).localeCompare(label(b))).map((m) => h("option", { value: m.user_id }, label(m))),
    );
    const key = h("textarea", { name: "public_key", required: true, rows: 2, placeholder: "ssh-ed25519 AAAA…" });
    const err = h("p", { class: "error", role: "alert", hidden: true });
    clear(
      sshSection,
      h("h2", { id: "h-ssh" }, "SSH access"),
      h("h3", null, "Your keys"),
      keys.length ? h("ul", null, keys.map((k) => h("li", null, `${k.name} `, h("code", null, k.fingerprint)))) : h("p", { class: "muted" }, "No personal key. ", h("a", { href: "#/keys" }, "Add one")),
      h("h3", null, "Grants"),
      table(
        ["User", "Fingerprint", "Origin", "Status", ""],
        grants.map((g) => [
          h("span", { "data-user-id": g.user_id ?? "" }, who(g.user_id)),
          h("code", null, g.fingerprint),
          g.origin,
          badge(g.status),
          g.status === "active"
            ? h("button", {
                type: "button",
                class: "secondary",
                onclick: async () => {
                  try {
                    await del(`${A}/allocations/${id}/ssh-grants/${g.grant_id}`);
                    await loadSsh();
                  } catch (ex) {
                    err.textContent = `Revoke failed: ${describe(ex)}`;
                    err.hidden = false;
                  }
                },
              }, "Revoke")
            : "",
        ]),
      ),
      h(
        "form",
        {
          class: "inline-form",
          onsubmit: async (e: Event) => {
            e.preventDefault();
            try {
              await post(`${A}/allocations/${id}/ssh-grants`, { user_id: user.value.trim(), public_key: key.value.trim() });
              await loadSsh();
            } catch (ex) {
              err.textContent = describe(ex);
              err.hidden = false;
            }
          },
        },
        h("h3", null, "Grant a project member access"),
        field("Project member", user, people.size ? undefined : "The project's members could not be listed."),
        field("Their public key", key),
        err,
        h("button", { type: "submit" }, "Grant access"),
      ),
    );
  };

  // Storage: what is attached (mount paths come from the project's volumes), attach and detach.
  const loadStorage = async () => {
    const projectVols = await get<Obj[]>(`${A}/projects/${alloc.project_id}/volumes`).catch(() => [] as Obj[]);
    const mountOf = (volumeId: string): string =>
      projectVols.find((v) => v.volume_id === volumeId)?.attachments?.find((a: Obj) => a.allocation_id === id)?.mount_path ?? "—";
    const vols: Obj[] = alloc.volumes ?? [];
    const attached = new Set(vols.map((v) => v.volume_id));
    const attachable = projectVols.filter(
      (v) => !attached.has(v.volume_id) && (v.status === "available" || (v.status === "attached" && v.access_mode === "multi_attach")),
    );
    const err = h("p", { class: "error", role: "alert", hidden: true });
    const change = async (what: string, fn: () => Promise<unknown>) => {
      err.hidden = true;
      try {
        await fn();
        alloc = await get<Obj>(`${A}/allocations/${id}`);
        paint();
        await loadStorage();
      } catch (ex) {
        err.textContent = `${what} failed: ${describe(ex)}`;
        err.hidden = false;
      }
    };
    const pick = h("select", { id: "attach-volume" }, attachable.map((v) => h("option", { value: v.volume_id }, `${v.name} (${v.size_gb} GB, ${v.access_mode})`)));
    const canChange = !["released", "releasing", "release_failed", "failed"].includes(alloc.status);
    clear(
      storage,
      h("h2", { id: "h-storage" }, "Storage"),
      table(
        ["Volume", "Mount path", "After release", ""],
        vols.map((v) => [
          v.name ?? v.volume_id,
          h("code", null, mountOf(v.volume_id)),
          v.after_release ?? (v.persist ? "kept" : "deleted"),
          canChange
            ? h("button", { type: "button", class: "secondary", onclick: () => change("Detach", () => del(`${A}/allocations/${id}/volumes/${v.volume_id}`)) }, `Detach ${v.name ?? ""}`.trim())
            : "",
        ]),
        "Attached volumes",
      ),
      canChange && attachable.length
        ? h(
            "div",
            { class: "inline-form" },
            field("Volume to attach", pick),
            h("button", { type: "button", onclick: () => change("Attach", () => post(`${A}/allocations/${id}/volumes`, { volume_id: pick.value })) }, "Attach volume"),
          )
        : canChange
          ? h("p", { class: "muted" }, "No other volume of this project can be attached. ", h("a", { href: "#/keys" }, "Create one"))
          : null,
      err,
    );
  };

  let costChart: { destroy: () => void } | null = null;
  const loadMetrics = async () => {
    const parts: HTMLElement[] = [h("h2", { id: "h-metrics" }, "Metrics and health")];
    try {
      // The project's meters (a list: no 404 while metering has not seen the activation yet).
      const meters = await get<Obj[]>("/api/metering/meters", { project_id: alloc.project_id, limit: 1000 });
      const m = meters.find((x) => x.allocation_id === id);
      if (!m) throw new Error("metering opens a meter when the allocation becomes active");
      parts.push(
        h(
          "dl",
          { class: "facts" },
          h("dt", null, "Meter"),
          h("dd", null, badge(m.status)),
          h("dt", null, "Metered since"),
          h("dd", null, when(m.opened_at)),
          h("dt", null, "Billed until"),
          h("dd", null, when(m.billed_until)),
          m.suspend_reason ? [h("dt", null, "Suspended"), h("dd", null, `${m.suspend_reason} at ${when(m.suspended_at)}`)] : null,
          m.closed_at ? [h("dt", null, "Closed"), h("dd", null, `${when(m.closed_at)} (${m.close_reason ?? ""})`)] : null,
        ),
      );
    } catch (ex) {
      parts.push(h("p", { class: "muted" }, `No usage meter yet: ${describe(ex)}`));
    }
    if (!canReadBilling(ctx, alloc.project_id, alloc.tenant_id)) {
      parts.push(h("p", { class: "muted" }, "Charges are visible to project and tenant admins."));
    } else try {
      const charges = await get<Obj[]>("/api/billing/charges", { project_id: alloc.project_id, allocation_id: id, limit: 1000 });
      costChart?.destroy();
      costChart = null;
      if (charges.length) {
        const { allocationCostChart } = await import("./insight"); // Chart.js loads with the first chart
        const made = allocationCostChart(charges);
        costChart = made;
        parts.push(h("p", { id: "alloc-cost", "data-total": made.figure.dataset.total, "data-currency": made.figure.dataset.currency }, `Cost so far: ${made.total}`), made.figure);
      } else {
        parts.push(h("p", { id: "alloc-cost", "data-total": "0" }, "Cost so far: nothing charged yet (charges appear as each hour closes, and at release)"));
      }
    } catch (ex) {
      parts.push(h("p", { class: "muted" }, `Charges are not available to you: ${describe(ex)}`));
    }
    clear(metrics, ...parts);
  };

  clear(
    main,
    header,
    h("nav", { class: "subnav", "aria-label": "Allocation sections" }, [
      h("a", { href: "#overview", onclick: jump("overview") }, "Overview"),
      h("a", { href: "#ssh", onclick: jump("ssh") }, "SSH access"),
      h("a", { href: "#storage", onclick: jump("storage") }, "Storage"),
      h("a", { href: "#activity", onclick: jump("activity") }, "Activity"),
      h("a", { href: "#metrics", onclick: jump("metrics") }, "Metrics"),
    ]),
    actions,
    notice,
    overview,
    h("section", { "aria-labelledby": "h-activity", id: "activity" }, h("h2", { id: "h-activity" }, "Activity (live)"), timelineList),
    sshSection,
    storage,
    metrics,
  );
  paint();
  void loadSsh();
  void loadStorage();
  void loadMetrics();

  // Live timeline: every entry, then new ones as they happen (SSE); the allocation is re-read on each.
  let refetch: number | undefined;
  const addEntry = (e: Obj) => {
    if (seen.has(e.seq)) return;
    seen.add(e.seq);
    timelineList.append(
      h(
        "li",
        { "data-phase": e.phase, "data-status": e.status },
        h("span", { class: "phase" }, e.phase),
        " ",
        badge(e.status),
        " ",
        h("span", null, e.message),
        h("time", { datetime: e.started_at }, ` ${when(e.started_at)}`),
      ),
    );
    window.clearTimeout(refetch);
    refetch = window.setTimeout(async () => {
      try {
        const before = alloc.status;
        alloc = await get<Obj>(`${A}/allocations/${id}`);
        paint();
        void loadStorage();
        if (alloc.status !== before) void loadMetrics();
      } catch {
        // keep the last state
      }
    }, 150);
  };
  const source = new EventSource(`${A}/allocations/${id}/timeline/stream?access_token=${encodeURIComponent(await token())}`);
  source.addEventListener("timeline", (ev) => addEntry(JSON.parse((ev as MessageEvent).data)));
  // Also poll the allocation now and then: status changes without a timeline entry still show.
  const poll = window.setInterval(async () => {
    try {
      const fresh = await get<Obj>(`${A}/allocations/${id}`);
      // A queued request's position and reason (and a waiting resize's reason) change without a new version.
      const moved =
        fresh.queue_position !== alloc.queue_position ||
        fresh.pending_reason !== alloc.pending_reason ||
        fresh.pending_resize_reason !== alloc.pending_resize_reason;
      if (fresh.version !== alloc.version || moved || fresh.preemption?.deadline !== alloc.preemption?.deadline) {
        alloc = fresh;
        paint();
      }
    } catch {
      // transient
    }
  }, 3000);
  // Countdowns (a preemption's deadline, a queued request's max wait) tick every second between repaints.
  const ticker = window.setInterval(() => {
    for (const el of overview.querySelectorAll<HTMLElement>(".countdown[data-until]")) el.textContent = span(secondsUntil(el.dataset.until!));
  }, 1000);
  return () => {
    source.close();
    window.clearInterval(poll);
    window.clearInterval(ticker);
    window.clearTimeout(refetch);
    costChart?.destroy();
  };
}

function jump(id: string) {
  return (e: Event) => {
    e.preventDefault();
    document.getElementById(id)?.scrollIntoView();
  };
}
