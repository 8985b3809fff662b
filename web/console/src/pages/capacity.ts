// Operators: capacity per host class over time (used and free GPUs, and the peak between instants) and which allocation holds each GPU
// of each host now (allocations' /capacity). Colours tell tenants apart in the occupancy grid.
import { get } from "../api";
import { chart, PALETTE } from "../charts";
import type { Obj } from "../context";
import { badge, h } from "../dom";
import type { Cleanup } from "../nav";

const HOURS = [6, 24, 72, 168];

export async function capacityPage(main: HTMLElement): Promise<Cleanup> {
  const hours = Number(new URLSearchParams(location.hash.split("?")[1] ?? "").get("hours") ?? 24);
  const [cap, tenants] = await Promise.all([
    get<Obj>("/api/allocations/capacity", { hours, points: hours <= 24 ? hours + 1 : 49 }),
    get<Obj[]>("/api/identity/tenants").catch(() => [] as Obj[]),
  ]);
  const tenantName = new Map(tenants.map((t) => [String(t.tenant_id), String(t.name)]));
  const destroy: Array<() => void> = [];
  const stamp = (iso: string) => {
    const d = new Date(iso);
    return hours <= 24 ? d.toISOString().slice(11, 16) : d.toISOString().slice(5, 13).replace("T", " ");
  };
  const classCharts = (cap.classes as Obj[]).map((c) => {
    const name = c.host_class ?? "no class";
    const made = chart({
      id: `chart-capacity-${String(name).replace(/[^\w-]/g, "_")}`,
      title: `${name}: GPUs used and free (${c.hosts} host${c.hosts === 1 ? "" : "s"}, ${c.used_gpus} of ${c.total_gpus} used now)`,
      labels: (c.points as Obj[]).map((p) => stamp(p.at)),
      series: [
        { label: "Used", values: (c.points as Obj[]).map((p) => p.used), stack: "gpus", color: "#2563eb" },
        { label: "Free", values: (c.points as Obj[]).map((p) => p.free), stack: "gpus", color: "#a7f3d0" },
        // The most used at once since the previous instant: an allocation between two bars shows here.
        { label: "Peak used", values: (c.points as Obj[]).map((p) => p.peak_used), kind: "line", stack: "peak", color: "#1e3a8a", dashed: true },
      ],
      unit: "GPUs",
      stacked: true,
    });
    made.figure.dataset.hostClass = name;
    made.figure.dataset.usedNow = String(c.used_gpus);
    made.figure.dataset.totalNow = String(c.total_gpus);
    destroy.push(made.destroy);
    return made.figure;
  });
  // One colour per tenant (stable within the page), white text on it.
  const colours = new Map<string, string>();
  const colourOf = (tenantId: string) => {
    if (!colours.has(tenantId)) colours.set(tenantId, PALETTE[colours.size % PALETTE.length]);
    return colours.get(tenantId)!;
  };
  const width = Math.max(0, ...(cap.hosts as Obj[]).map((x) => (x.gpus as Obj[]).length));
  const grid = h(
    "div",
    { class: "table-wrap" },
    h(
      "table",
      { class: "occupancy", id: "occupancy" },
      h("caption", null, "GPU occupancy now: each cell is one GPU of a host"),
      h("thead", null, h("tr", null, h("th", { scope: "col" }, "Host"), h("th", { scope: "col" }, "Class"), Array.from({ length: width }, (_, i) => h("th", { scope: "col" }, `GPU ${i}`)))),
      h(
        "tbody",
        null,
        (cap.hosts as Obj[]).map((x) =>
          h(
            "tr",
            { "data-host": x.name },
            h("th", { scope: "row" }, x.name, " ", badge(x.status)),
            h("td", null, x.host_class ?? "—"),
            (x.gpus as Obj[]).map((g) => {
              if (!g.allocation_id) return h("td", { class: "gpu free", "data-gpu": g.index, title: `${g.model}: free` }, "free");
              const cell = h(
                "td",
                {
                  class: "gpu used",
                  "data-gpu": g.index,
                  "data-allocation": g.allocation_id,
                  title: `${g.model}: ${g.allocation_name || g.allocation_id} (${tenantName.get(g.tenant_id) ?? g.tenant_id}, ${g.status})`,
                },
                g.allocation_name || String(g.allocation_id).slice(0, 8),
              );
              cell.style.backgroundColor = colourOf(String(g.tenant_id));
              return cell;
            }),
          ),
        ),
      ),
    ),
  );
  const legend = h(
    "p",
    { class: "muted" },
    [...colours].map(([tid, colour]) => {
      const swatch = h("span", { class: "legend-swatch", "aria-hidden": "true" });
      swatch.style.backgroundColor = colour;
      return h("span", { class: "inline" }, swatch, `${tenantName.get(tid) ?? tid.slice(0, 8)} `);
    }),
  );
  main.append(
    h("h1", null, "Capacity"),
    h(
      "nav",
      { "aria-label": "Time range", class: "subnav" },
      HOURS.map((n) => h("a", { href: `#/admin/capacity?hours=${n}`, "aria-current": n === hours ? "true" : null }, n < 48 ? `${n} h` : `${n / 24} days`)),
    ),
    h("section", { "aria-labelledby": "h-cap-classes" }, h("h2", { id: "h-cap-classes" }, "Per host class"), classCharts.length ? h("div", { class: "charts" }, classCharts) : h("p", { class: "empty" }, "No hosts enrolled.")),
    h("section", { "aria-labelledby": "h-occupancy" }, h("h2", { id: "h-occupancy" }, "Occupancy"), grid, legend),
    h("p", { class: "help" }, "The series is reconstructed from enrolment, placement and release times (an allocation counts with its current GPU count); the occupancy is exact."),
  );
  return () => destroy.forEach((d) => d());
}
