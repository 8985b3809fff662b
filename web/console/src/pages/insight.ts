// Usage and spend as pictures (issue 21): spend per day of the current and previous billing period with
// the budget lines (billing's /costs/daily), GPU-hours by project and by GPU model (metering's
// /usage/gpu-hours), and an allocation's cost so far (its charges). Every chart carries its numbers.
import { get } from "../api";
import { chart } from "../charts";
import type { Obj } from "../context";
import { h } from "../dom";
import { money } from "../money";

export type Scope = { tenant_id: string } | { project_id: string };

function periodOf(iso: string): string {
  return iso.slice(0, 7);
}

function previousPeriod(period: string): string {
  const [y, m] = period.split("-").map(Number);
  return m === 1 ? `${y - 1}-12` : `${y}-${String(m - 1).padStart(2, "0")}`;
}

function daysIn(period: string): number {
  const [y, m] = period.split("-").map(Number);
  return new Date(Date.UTC(y, m, 0)).getUTCDate();
}

const round6 = (v: number) => Math.round(v * 1e6) / 1e6;

/** Spend per day of this period and the last, cumulative, with the budget lines; in one currency (the
 * first this period charged in, else the budgets', else the previous period's). */
export async function spendChart(scope: Scope): Promise<{ figure: HTMLElement; destroy: () => void; note: HTMLElement | null }> {
  const current = await get<Obj>("/api/billing/costs/daily", scope);
  const period = periodOf(current.period_start);
  const previous = await get<Obj>("/api/billing/costs/daily", { ...scope, period: previousPeriod(period) });
  const currencies = [...new Set<string>([...current.days, ...(current.budgets as Obj[]), ...previous.days].map((d: Obj) => d.currency))];
  const currency = currencies[0] ?? "USD";
  const n = Math.max(daysIn(period), daysIn(previousPeriod(period)));
  const labels = Array.from({ length: n }, (_, i) => String(i + 1));
  const perDay = (rows: Obj[], len: number) => {
    const out = Array<number>(len).fill(0);
    for (const d of rows) if (d.currency === currency) out[Number(String(d.day).slice(8, 10)) - 1] += Number(d.amount);
    return out.map(round6);
  };
  const cumulative = (daily: number[], upTo: number) => {
    let sum = 0;
    return daily.map((v, i) => (i < upTo ? round6((sum += v)) : null));
  };
  const today = new Date();
  const isCurrent = period === today.toISOString().slice(0, 7);
  const daysSoFar = isCurrent ? today.getUTCDate() : daysIn(period);
  const currentDaily = perDay(current.days, n).map((v, i) => (i < daysIn(period) ? v : 0));
  const previousDaily = perDay(previous.days, n);
  const series = [
    { label: "This period, per day", values: currentDaily.map((v, i) => (i < daysSoFar ? v : null)), kind: "bar" as const },
    { label: "This period, so far", values: cumulative(currentDaily, daysSoFar), kind: "line" as const },
    { label: "Previous period, so far", values: cumulative(previousDaily, daysIn(previousPeriod(period))), kind: "line" as const, dashed: true, color: "#6b7280" },
    ...(current.budgets as Obj[])
      .filter((b) => b.currency === currency)
      .map((b, i) => ({
        label: `Budget ${b.name || i + 1}`,
        values: labels.map(() => Number(b.limit_amount)),
        kind: "line" as const,
        dashed: true,
        color: "#dc2626",
      })),
  ];
  const made = chart({
    id: "chart-spend-daily",
    title: `Spend per day, ${period} against ${previousPeriod(period)} (${currency})`,
    labels,
    series,
    unit: currency,
    format: (v) => money(v, currency),
  });
  const total = currentDaily.reduce((a, b) => a + b, 0);
  made.figure.dataset.currency = currency;
  made.figure.dataset.total = String(round6(total));
  const others = currencies.slice(1);
  const note = others.length ? h("p", { class: "muted" }, `Also charged in ${others.join(", ")}: see the totals above.`) : null;
  return { ...made, note };
}

/** GPU-hours of this month per project and per GPU model (the projects the caller may read). */
export async function gpuHoursCharts(projectName: (id: string) => string, projectId?: string): Promise<{ figures: HTMLElement[]; destroy: () => void }> {
  const data = await get<Obj>("/api/metering/usage/gpu-hours", { project_id: projectId });
  const rows = data.rows as Obj[];
  const sum = (key: string) => {
    const m = new Map<string, number>();
    for (const r of rows) m.set(String(r[key]), round6((m.get(String(r[key])) ?? 0) + Number(r.gpu_hours)));
    return [...m].sort((a, b) => b[1] - a[1]);
  };
  const byProject = sum("project_id");
  const byModel = sum("gpu_model");
  const hours = (v: number) => `${v} GPU-hours`;
  const a = chart({
    id: "chart-gpu-hours-project",
    title: "GPU-hours this month, by project",
    labels: byProject.map(([p]) => projectName(p)),
    series: [{ label: "GPU-hours", values: byProject.map(([, v]) => v) }],
    unit: "GPU-hours",
    format: hours,
  });
  const b = chart({
    id: "chart-gpu-hours-model",
    title: "GPU-hours this month, by GPU model",
    labels: byModel.map(([m]) => m),
    series: [{ label: "GPU-hours", values: byModel.map(([, v]) => v) }],
    unit: "GPU-hours",
    format: hours,
  });
  a.figure.dataset.total = b.figure.dataset.total = String(round6(rows.reduce((s, r) => s + Number(r.gpu_hours), 0)));
  return { figures: [a.figure, b.figure], destroy: () => (a.destroy(), b.destroy()) };
}

/** An allocation's charges over time (cumulative, by the end of each charged window) and the total. */
export function allocationCostChart(charges: Obj[]): { figure: HTMLElement; destroy: () => void; total: string } {
  const byCurrency = new Map<string, number>();
  const sorted = [...charges].sort((x, y) => String(x.usage_end).localeCompare(String(y.usage_end)));
  const currency = sorted[0]?.currency ?? "USD";
  let sum = 0;
  const stamp = (iso: string) => new Date(iso).toISOString().slice(5, 16).replace("T", " ");
  const mine = sorted.filter((c) => c.currency === currency);
  // From nothing at the start of the first charged window, then the running total at the end of each.
  const points: Array<readonly [string, number]> = mine.length ? [[stamp(mine[0].usage_start), 0]] : [];
  for (const c of mine) {
    sum += Number(c.amount);
    points.push([stamp(c.usage_end), round6(sum)]);
  }
  for (const c of charges) byCurrency.set(c.currency, (byCurrency.get(c.currency) ?? 0) + Number(c.amount));
  const made = chart({
    id: "chart-allocation-cost",
    title: `Cost so far (${currency})`,
    labels: points.map(([t]) => t),
    series: [{ label: "Cost so far", values: points.map(([, v]) => v), kind: "line", fill: true }],
    unit: currency,
    format: (v) => money(v, currency),
  });
  const total = [...byCurrency].map(([c, v]) => money(v, c)).join(" + ");
  made.figure.dataset.total = String(round6(byCurrency.get(currency) ?? 0));
  made.figure.dataset.currency = currency;
  return { ...made, total };
}
