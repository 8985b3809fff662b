import { describe, get, post } from "../api";
import { canReadBilling, type Context, type Obj } from "../context";
import { clear, field, h, table, when } from "../dom";
import { money, totals } from "../money";
import type { Cleanup } from "../nav";

const B = "/api/billing";

export async function billing(main: HTMLElement, _p: string[], ctx: Context): Promise<Cleanup> {
  main.append(h("h1", null, "Billing and usage"));
  const destroy: Array<() => void> = [];
  const cleanup = () => destroy.forEach((d) => d());
  // The charts (and Chart.js) load only on the pages that draw them.
  const { gpuHoursCharts, spendChart } = await import("./insight");
  const tenantId = ctx.project?.tenant_id;
  const isTenantAdmin = !!tenantId && (ctx.tenantAdminOf.has(tenantId) || ctx.operator);
  const costsBox = h("section", { "aria-labelledby": "h-costs", id: "costs" });
  const budgetsBox = h("section", { "aria-labelledby": "h-budgets" });
  const statementsBox = h("section", { "aria-labelledby": "h-statements" });
  const breakdownBox = h("section", { "aria-labelledby": "h-breakdown" });
  const usageBox = h("section", { "aria-labelledby": "h-usage", id: "usage" }, h("h2", { id: "h-usage" }, "GPU usage"));
  const spendBox = h("section", { "aria-labelledby": "h-spend", id: "spend" });
  main.append(costsBox, spendBox, usageBox, budgetsBox, statementsBox);
  if (ctx.operator) main.append(breakdownBox);
  const projectName = new Map(ctx.projects.map((p) => [p.project_id, p.name]));
  const nameOf = (id: string) => projectName.get(id) ?? `project ${id.slice(0, 8)}`;

  // GPU-hours (metering: every member may read their projects'): the whole tenant for its admins and
  // operators (every project they can read), else the selected project.
  try {
    const charts = await gpuHoursCharts(nameOf, isTenantAdmin ? undefined : ctx.project?.project_id);
    destroy.push(charts.destroy);
    usageBox.append(h("div", { class: "charts" }, charts.figures));
  } catch (ex) {
    usageBox.append(h("p", { class: "muted" }, `GPU usage is not available: ${describe(ex)}`));
  }

  if (!canReadBilling(ctx, ctx.project?.project_id, tenantId)) {
    costsBox.append(h("p", { class: "muted" }, "Costs are visible to project admins, tenant admins and operators."));
    return cleanup;
  }
  // Current-period combined cost: the whole tenant for tenant admins, else the selected project.
  try {
    const costs = await get<Obj>(`${B}/costs`, isTenantAdmin ? { tenant_id: tenantId } : { project_id: ctx.project?.project_id });
    clear(
      costsBox,
      h("h2", { id: "h-costs" }, `Current period (${when(costs.period_start)} – ${when(costs.period_end)})`),
      (costs.totals as Obj[]).length
        ? h("p", { class: "total", id: "cost-total", "data-amounts": JSON.stringify(costs.totals) }, (costs.totals as Obj[]).map((t) => money(t.amount, t.currency)).join(" + "))
        : h("p", { class: "total", id: "cost-total", "data-amounts": "[]" }, "No charges yet this period"),
      table(
        ["Project", "GPU time", "App usage", "Total"],
        (costs.projects as Obj[]).map((p) => [nameOf(p.project_id), money(p.gpu_amount, p.currency), money(p.app_amount, p.currency), money(p.amount, p.currency)]),
        "Cost per project",
      ),
    );
  } catch (ex) {
    clear(costsBox, h("h2", { id: "h-costs" }, "Current period"), h("p", { class: "muted" }, `Costs are not available: ${describe(ex)}`));
  }

  try {
    const scope = isTenantAdmin ? { tenant_id: tenantId! } : { project_id: ctx.project!.project_id };
    const spend = await spendChart(scope);
    destroy.push(spend.destroy);
    clear(spendBox, h("h2", { id: "h-spend" }, "Spend per day"), spend.figure, spend.note);
  } catch (ex) {
    clear(spendBox, h("h2", { id: "h-spend" }, "Spend per day"), h("p", { class: "muted" }, `Not available: ${describe(ex)}`));
  }

  if (isTenantAdmin) {
    const loadBudgets = async () => {
      const budgets = await get<Obj[]>(`${B}/budgets`, { tenant_id: tenantId });
      const name = h("input", { required: true, value: "monthly" });
      const limit = h("input", { type: "number", min: 0.01, step: "0.01", required: true, value: 1000 });
      const currency = h("input", { required: true, value: "USD", maxlength: 3, minlength: 3 });
      const err = h("p", { class: "error", role: "alert", hidden: true });
      clear(
        budgetsBox,
        h("h2", { id: "h-budgets" }, "Budgets"),
        table(
          ["Name", "Scope", "Limit", "Spent", "Thresholds"],
          budgets.map((b) => [b.name, b.project_id ? nameOf(b.project_id) : "whole tenant", money(b.limit_amount, b.currency), money(b.spent_amount ?? "0", b.currency), (b.thresholds ?? []).map((t: number) => `${t}%`).join(", ")]),
        ),
        h(
          "form",
          {
            class: "inline-form",
            onsubmit: async (e: Event) => {
              e.preventDefault();
              try {
                await post(`${B}/budgets`, { tenant_id: tenantId, name: name.value, limit_amount: limit.value, currency: currency.value.toUpperCase(), thresholds: [50, 80, 100] });
                await loadBudgets();
              } catch (ex) {
                err.textContent = describe(ex);
                err.hidden = false;
              }
            },
          },
          h("h3", null, "New budget"),
          field("Budget name", name),
          field("Limit", limit),
          field("Currency", currency),
          err,
          h("button", { type: "submit" }, "Create budget"),
        ),
      );
    };
    await loadBudgets().catch((ex) => clear(budgetsBox, h("h2", { id: "h-budgets" }, "Budgets"), h("p", { class: "muted" }, describe(ex))));
    try {
      const statements = await get<Obj[] | Obj>(`${B}/statements`, { tenant_id: tenantId });
      const rows: Obj[] = Array.isArray(statements) ? statements : (statements.items ?? []);
      clear(
        statementsBox,
        h("h2", { id: "h-statements" }, "Statements"),
        table(
          ["Period", "Total", "Closed"],
          rows.map((s) => [s.period ?? when(s.period_start), s.currency ? money(s.total_amount ?? s.amount ?? 0, s.currency) : "—", when(s.closed_at ?? s.created_at)]),
        ),
      );
    } catch (ex) {
      clear(statementsBox, h("h2", { id: "h-statements" }, "Statements"), h("p", { class: "muted" }, describe(ex)));
    }
  } else {
    clear(budgetsBox, h("h2", { id: "h-budgets" }, "Budgets and statements"), h("p", { class: "muted" }, "Budgets and statements are managed by your tenant admins."));
  }

  if (ctx.operator) {
    try {
      const [rows, tenants] = await Promise.all([get<Obj[]>(`${B}/costs/breakdown`), get<Obj[]>("/api/identity/tenants").catch(() => [] as Obj[])]);
      const tenantName = new Map(tenants.map((t) => [String(t.tenant_id), String(t.name)]));
      clear(
        breakdownBox,
        h("h2", { id: "h-breakdown" }, "Operator breakdown (tenant × project × SKU × app)"),
        table(
          ["Tenant", "Project", "SKU", "App", "Quantity", "Amount", "Charges"],
          rows.map((r) => [tenantName.get(r.tenant_id) ?? r.tenant_id.slice(0, 8), nameOf(r.project_id), r.sku, r.app_slug ?? "—", `${r.quantity} ${r.unit}`, money(r.amount, r.currency), r.charges]),
        ),
        h("p", { class: "muted" }, `Total: ${totals(rows, "nothing charged yet this period")}`),
      );
    } catch (ex) {
      clear(breakdownBox, h("h2", { id: "h-breakdown" }, "Operator breakdown"), h("p", { class: "muted" }, describe(ex)));
    }
  }
  return cleanup;
}
