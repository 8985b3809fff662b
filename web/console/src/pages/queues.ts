// Capacity queues (issue 29): per GPU model, each queue's usage against its guarantee, limit and weight, what it
// borrows and lends, its waiting requests and why they wait, and a chart of each queue's share (GPUs held) over
// time. Operators see every tenant's queue (and the projects holding or waiting); a tenant admin sees the
// tenant's queue and its projects'. Data: allocations' /queues (operators) or /tenants/{id}/queues, and
// /queue-history (operators) or /tenants/{id}/queue-history.
import { get } from "../api";
import { chart, PALETTE } from "../charts";
import type { Context, Obj } from "../context";
import { h, when } from "../dom";
import type { Cleanup } from "../nav";
import { reasonText } from "../queueing";

const A = "/api/allocations";
const HOURS = [6, 24, 72, 168];

export async function queuesPage(main: HTMLElement, ctx: Context): Promise<Cleanup | void> {
  const tenantIds = [...ctx.tenantAdminOf];
  if (!ctx.operator && !tenantIds.length) {
    main.append(h("h1", null, "Capacity queues"), h("p", { class: "empty" }, "Capacity queues are shown to tenant admins and operators."));
    return;
  }
  const asked = Number(new URLSearchParams(location.hash.split("?")[1] ?? "").get("hours") ?? 24);
  const hours = HOURS.includes(asked) ? asked : 24; // the API takes at most 62 days
  const range = { since: new Date(Date.now() - hours * 3600_000).toISOString(), points: hours <= 24 ? hours + 1 : 49 };
  const [views, histories, tenants] = await Promise.all([
    ctx.operator
      ? get<Obj[]>(`${A}/queues`)
      : Promise.all(tenantIds.map((t) => get<Obj[]>(`${A}/tenants/${t}/queues`))).then((l) => l.flat()),
    ctx.operator
      ? get<Obj>(`${A}/queue-history`, range).then((x) => [x])
      : Promise.all(tenantIds.map((t) => get<Obj>(`${A}/tenants/${t}/queue-history`, range))),
    get<Obj[]>("/api/identity/tenants").catch(() => [] as Obj[]),
  ]);
  const tenantName = new Map(tenants.map((t) => [String(t.tenant_id), String(t.name)]));
  const projectName = new Map(ctx.projects.map((p) => [p.project_id, p.name]));
  const nameOf = (q: Obj) =>
    q.scope === "tenant" ? tenantName.get(q.scope_id) ?? `tenant ${String(q.scope_id).slice(0, 8)}` : projectName.get(q.scope_id) ?? `project ${String(q.scope_id).slice(0, 8)}`;
  const shares: Obj[] = histories.flatMap((x) => x.queues as Obj[]);
  const models = [...new Set([...views.map((q) => String(q.gpu_model)), ...shares.map((q) => String(q.gpu_model))])].sort();

  // The waiting requests of the projects that wait (and that this user can list), with their place and reason.
  const waitingProjects = [...new Set(views.filter((q) => q.scope === "project" && q.waiting > 0).map((q) => String(q.scope_id)))];
  const queued = (
    await Promise.all(
      waitingProjects
        .filter((pid) => projectName.has(pid))
        .map((pid) => get<Obj[]>(`${A}/projects/${pid}/allocations`).catch(() => [] as Obj[])),
    )
  )
    .flat()
    .filter((a) => a.status === "queued");

  const destroy: Array<() => void> = [];
  const stamp = (iso: string) => {
    const d = new Date(iso);
    return hours <= 24 ? d.toISOString().slice(11, 16) : d.toISOString().slice(5, 13).replace("T", " ");
  };
  const sections = models.map((model) => {
    const rows = views.filter((q) => q.gpu_model === model);
    const usage = !rows.length
      ? h("p", { class: "empty" }, `No queue of ${model} holds or waits for GPUs now (the chart shows what they held).`)
      : h(
          "div",
          { class: "table-wrap" },
          h(
            "table",
            { class: "queues", "data-gpu-model": model },
            h("caption", null, `${model}: usage now against each queue's guarantee, limit and weight`),
            h(
              "thead",
              null,
              h(
                "tr",
                null,
                ["Queue", "In use", "Guarantee", "Limit", "Lend limit", "Weight", "Borrowed", "Lent", "Waiting", "Why they wait"].map((t) => h("th", { scope: "col" }, t)),
              ),
            ),
            h(
              "tbody",
              null,
              rows.map((q) =>
                h(
                  "tr",
                  { "data-scope": q.scope, "data-scope-id": q.scope_id, "data-waiting": q.waiting, "data-in-use": q.in_use },
                  h("th", { scope: "row", class: q.scope === "project" ? "indent" : null }, nameOf(q), h("span", { class: "muted" }, ` (${q.scope})`)),
                  h("td", null, String(q.in_use)),
                  h("td", null, String(q.guarantee)),
                  h("td", null, q.limit ?? "none"),
                  h("td", null, q.lend_limit ?? "all unused"),
                  h("td", null, String(q.weight)),
                  h("td", null, String(q.borrowed)),
                  h("td", null, String(q.lent)),
                  h("td", null, q.waiting ? `${q.waiting} request${q.waiting === 1 ? "" : "s"} (${q.waiting_gpus} GPUs)` : "—"),
                  h(
                    "td",
                    { class: "reasons" },
                    Object.keys(q.pending_reasons ?? {}).length
                      ? h("ul", null, Object.entries(q.pending_reasons as Record<string, number>).map(([r, n]) => h("li", { "data-reason": r }, `${n} × ${reasonText(r)}`)))
                      : "—",
                  ),
                ),
              ),
            ),
          ),
        );
    // The share over time: one stacked series per queue (tenants for operators; a tenant admin's projects, with
    // the tenant's guarantee as a line).
    const modelShares = shares.filter((q) => q.gpu_model === model);
    const stacked = ctx.operator ? modelShares.filter((q) => q.scope === "tenant") : modelShares.filter((q) => q.scope === "project");
    const tenantShares = modelShares.filter((q) => q.scope === "tenant");
    const labels = ((stacked[0] ?? tenantShares[0])?.points as Obj[] | undefined)?.map((p) => stamp(p.at)) ?? [];
    let figure: HTMLElement | null = null;
    if (labels.length && (stacked.length || tenantShares.length)) {
      const made = chart({
        id: `chart-queue-share-${model.replace(/[^\w-]/g, "_")}`,
        // The time-weighted mean of each interval: an allocation that came and went between two instants still shows.
        title: `${model}: GPUs held per queue (mean of each interval), last ${hours < 48 ? `${hours} h` : `${hours / 24} days`}`,
        labels,
        series: [
          ...stacked.map((q, i) => ({ label: nameOf(q), values: (q.points as Obj[]).map((p) => p.mean), stack: "held", color: PALETTE[i % PALETTE.length] })),
          ...(ctx.operator
            ? []
            : tenantShares
                .filter((q) => q.guarantee > 0)
                .map((q) => ({ label: `${nameOf(q)} guarantee`, values: (q.points as Obj[]).map(() => q.guarantee), kind: "line" as const, stack: "guarantee", color: "#111827", dashed: true }))),
        ],
        unit: "GPUs",
        stacked: true,
        format: (v) => (Number.isInteger(v) ? String(v) : v.toFixed(2)),
      });
      made.figure.dataset.gpuModel = model;
      // The window the series covers (as the API answered it): what a reader can ask the API for again.
      made.figure.dataset.since = histories[0]?.since ?? "";
      made.figure.dataset.until = histories[0]?.until ?? "";
      destroy.push(made.destroy);
      figure = made.figure;
    }
    const waiting = queued.filter((a) => a.gpu_model === model).sort((a, b) => (a.queue_position ?? 0) - (b.queue_position ?? 0));
    const waitingTable = waiting.length
      ? h(
          "div",
          { class: "table-wrap" },
          h(
            "table",
            { class: "waiting", "data-gpu-model": model },
            h("caption", null, `${model}: waiting requests`),
            h("thead", null, h("tr", null, ["Request", "Project", "GPUs", "Position", "Why it waits", "Priority", "Waiting since", "Max wait"].map((t) => h("th", { scope: "col" }, t)))),
            h(
              "tbody",
              null,
              waiting.map((a) =>
                h(
                  "tr",
                  { "data-allocation": a.allocation_id, "data-reason": a.pending_reason ?? "" },
                  h("td", null, h("a", { href: `#/allocations/${a.allocation_id}` }, a.name || a.allocation_id)),
                  h("td", null, projectName.get(a.project_id) ?? a.project_id),
                  h("td", null, String(a.gpu_count)),
                  h("td", null, a.queue_position ?? "—"),
                  h("td", null, reasonText(a.pending_reason)),
                  h("td", null, String(a.priority ?? 0)),
                  h("td", null, when(a.status_changed_at)),
                  h("td", null, a.max_wait_s ? `${a.max_wait_s} s` : "none"),
                ),
              ),
            ),
          ),
        )
      : null;
    return h(
      "section",
      { "aria-labelledby": `h-queue-${model}`, "data-gpu-model": model },
      h("h2", { id: `h-queue-${model}` }, model),
      usage,
      waitingTable,
      figure,
    );
  });
  // The heading last: a reader (and the browser tests) waiting for it find the page drawn.
  main.append(
    h("h1", null, "Capacity queues"),
    h(
      "nav",
      { "aria-label": "Time range", class: "subnav" },
      HOURS.map((n) => h("a", { href: `#/queues?hours=${n}`, "aria-current": n === hours ? "true" : null }, n < 48 ? `${n} h` : `${n / 24} days`)),
    ),
    ...(sections.length ? sections : [h("p", { class: "empty" }, "No queue has settings, holds or waits for GPUs.")]),
    h(
      "p",
      { class: "help" },
      "A queue's guarantee is what it gets whenever it asks; above it, it borrows others' unused guarantees (lent), up to its limit, " +
        "and the surplus is shared by weight. Borrowed GPUs may be reclaimed (preempted, with notice) for a queue below its guarantee. " +
        "The chart is reconstructed from placement, admission and release times (an allocation counts with its current GPU count).",
    ),
  );
  return () => destroy.forEach((d) => d());
}
