import { describe, get, post } from "../api";
import { canReadBilling, type Context, type Obj } from "../context";
import { clear, field, h, table, when } from "../dom";

const B = "/api/billing";

function money(amount: string | number, currency: string): string {
  return `${amount} ${currency}`;
}

export async function billing(main: HTMLElement, _p: string[], ctx: Context): Promise<void> {
  main.append(h("h1", null, "Billing"));
  const tenantId = ctx.project?.tenant_id;
  const isTenantAdmin = !!tenantId && (ctx.tenantAdminOf.has(tenantId) || ctx.operator);
  const costsBox = h("section", { "aria-labelledby": "h-costs", id: "costs" });
  const budgetsBox = h("section", { "aria-labelledby": "h-budgets" });
  const statementsBox = h("section", { "aria-labelledby": "h-statements" });
  const breakdownBox = h("section", { "aria-labelledby": "h-breakdown" });
  main.append(costsBox, budgetsBox, statementsBox);
  if (ctx.operator) main.append(breakdownBox);
  const projectName = new Map(ctx.projects.map((p) => [p.project_id, p.name]));

  if (!canReadBilling(ctx, ctx.project?.project_id, tenantId)) {
    costsBox.append(h("p", { class: "muted" }, "Costs are visible to project admins, tenant admins and operators."));
    return;
  }
  // Current-period combined cost: the whole tenant for tenant admins, else the selected project.
  try {
    const costs = await get<Obj>(`${B}/costs`, isTenantAdmin ? { tenant_id: tenantId } : { project_id: ctx.project?.project_id });
    clear(
      costsBox,
      h("h2", { id: "h-costs" }, `Current period (${when(costs.period_start)} – ${when(costs.period_end)})`),
      (costs.totals as Obj[]).length
        ? h("p", { class: "total", id: "cost-total" }, (costs.totals as Obj[]).map((t) => money(t.amount, t.currency)).join(" + "))
        : h("p", { class: "total", id: "cost-total" }, "0.00 (no charges yet this period)"),
      table(
        ["Project", "GPU time", "App usage", "Total"],
        (costs.projects as Obj[]).map((p) => [projectName.get(p.project_id) ?? p.project_id, money(p.gpu_amount, p.currency), money(p.app_amount, p.currency), money(p.amount, p.currency)]),
        "Cost per project",
      ),
    );
  } catch (ex) {
    clear(costsBox, h("h2", { id: "h-costs" }, "Current period"), h("p", { class: "muted" }, `Costs are not available: ${describe(ex)}`));
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
          budgets.map((b) => [b.name, b.project_id ? projectName.get(b.project_id) ?? b.project_id : "whole tenant", money(b.limit_amount, b.currency), money(b.spent_amount ?? "0", b.currency), (b.thresholds ?? []).map((t: number) => `${t}%`).join(", ")]),
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
          rows.map((s) => [s.period ?? when(s.period_start), money(s.total_amount ?? s.amount ?? "—", s.currency ?? ""), when(s.closed_at ?? s.created_at)]),
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
      const rows = await get<Obj[]>(`${B}/costs/breakdown`);
      clear(
        breakdownBox,
        h("h2", { id: "h-breakdown" }, "Operator breakdown (tenant × project × SKU × app)"),
        table(
          ["Tenant", "Project", "SKU", "App", "Quantity", "Amount", "Charges"],
          rows.map((r) => [r.tenant_id.slice(0, 8), projectName.get(r.project_id) ?? r.project_id.slice(0, 8), r.sku, r.app_slug ?? "—", `${r.quantity} ${r.unit}`, money(r.amount, r.currency), r.charges]),
        ),
      );
    } catch (ex) {
      clear(breakdownBox, h("h2", { id: "h-breakdown" }, "Operator breakdown"), h("p", { class: "muted" }, describe(ex)));
    }
  }
}
