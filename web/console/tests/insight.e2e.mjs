// Issues 21 and 29: the console's charts with the data of a real metered run, read back for the Python side to
// compare with the billing, metering and allocations APIs. Each chart is screenshotted (whole page and the
// chart alone); each chart's numbers are read from its figure (`data-values`, `data-total`), and its canvas
// must have been drawn.
//
//   GATEWAY_URL, USER_EMAIL, USER_PASSWORD (a tenant admin), ADMIN_EMAIL, ADMIN_PASSWORD (an operator),
//   ALLOCATION (a released, charged allocation of the user), HOST_CLASS, MEMBER_EMAIL, SCREENSHOT_DIR
import { join } from "node:path";
import { env, openBrowser } from "./browser.mjs";

const BASE = env("GATEWAY_URL").replace(/\/$/, "");
const USER = { email: env("USER_EMAIL"), password: env("USER_PASSWORD") };
const ADMIN = { email: env("ADMIN_EMAIL"), password: env("ADMIN_PASSWORD") };
const ALLOCATION = env("ALLOCATION");
const HOST_CLASS = env("HOST_CLASS");
const MEMBER_EMAIL = env("MEMBER_EMAIL");
const SHOTS = env("SCREENSHOT_DIR");

const b = await openBrowser();
const { page, step, shot, checkA11y, heading, waitText } = b;
const result = { charts: {} };

async function signIn(who) {
  await page.goto(`${BASE}/`);
  await heading("Sign in to GPUaaS");
  await page.getByRole("tab", { name: "Personal account" }).click();
  await page.getByLabel("Email", { exact: true }).fill(who.email);
  await page.getByLabel("Password").fill(who.password);
  await page.getByRole("button", { name: "Sign in" }).click();
  await heading("Allocations");
}

/** A chart's numbers (and that its canvas has pixels drawn), and a screenshot of the chart alone. */
async function readChart(id) {
  const fig = page.locator(`figure#${id}`);
  await fig.waitFor();
  await page.waitForFunction(
    (sel) => {
      const c = document.querySelector(`${sel} canvas`);
      if (!c || !c.width || !c.height) return false;
      const data = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
      for (let i = 3; i < data.length; i += 4) if (data[i] !== 0) return true;
      return false;
    },
    `figure#${id}`,
    { timeout: 30000 },
  );
  const attrs = await fig.evaluate((el) => ({ ...el.dataset }));
  const values = JSON.parse(attrs.values);
  const path = join(SHOTS, `chart-${id}.png`);
  await fig.scrollIntoViewIfNeeded();
  await fig.screenshot({ path });
  result.charts[id] = { ...attrs, values, screenshot: path };
  return result.charts[id];
}

await b.run(result, async () => {
  await step("tenant admin signs in; no operator menu", async () => {
    await signIn(USER);
    result.operatorNav = await page.getByRole("navigation", { name: "Operator" }).count();
    if (result.operatorNav !== 0) throw new Error("a tenant sees the operator menu");
    if (await page.getByText("Operator:").count()) throw new Error("'Operator:' is shown to a tenant");
  });

  await step("billing: spend per day and GPU-hours charts", async () => {
    await page.goto(`${BASE}/#/billing`);
    await heading("Billing");
    await readChart("chart-spend-daily");
    await readChart("chart-gpu-hours-project");
    await readChart("chart-gpu-hours-model");
    result.costTotal = JSON.parse((await page.locator("#cost-total").getAttribute("data-amounts")) ?? "[]");
    result.costText = (await page.locator("#cost-total").textContent())?.trim();
    await checkA11y("billing with charts");
    await shot("billing-charts");
  });

  await step("allocation page: cost so far and the member picker", async () => {
    await page.goto(`${BASE}/#/allocations/${ALLOCATION}`);
    await waitText("#alloc-status", /^released$/);
    await page.locator("#alloc-cost[data-total]").waitFor();
    await readChart("chart-allocation-cost");
    result.allocCost = await page.locator("#alloc-cost").evaluate((el) => ({ ...el.dataset, text: el.textContent }));
    const picker = page.locator("#ssh").getByLabel("Project member");
    result.memberOptions = await picker.locator("option").allTextContents();
    if (!result.memberOptions.some((o) => o.includes(MEMBER_EMAIL))) throw new Error(`member picker: ${result.memberOptions}`);
    await checkA11y("allocation with cost chart");
    await shot("allocation-cost");
  });

  await step("tenant admin: the queue page (usage now and each queue's share over time)", async () => {
    await page.getByRole("navigation", { name: "Main" }).getByRole("link", { name: "Queues" }).click();
    await heading("Capacity queues");
    result.queueCharts = [];
    for (const fig of await page.locator("figure[data-gpu-model]").all()) {
      const id = await fig.getAttribute("id");
      await readChart(id);
      result.queueCharts.push(id);
    }
    result.queueRows = await page.locator("table.queues tr[data-scope]").evaluateAll((rows) =>
      rows.map((r) => ({
        gpu_model: r.closest("table").dataset.gpuModel,
        scope: r.dataset.scope,
        scope_id: r.dataset.scopeId,
        in_use: Number(r.dataset.inUse),
        waiting: Number(r.dataset.waiting),
      })),
    );
    await checkA11y("queues");
    await shot("tenant-queues");
  });

  await step("operator: capacity per host class and occupancy", async () => {
    await page.getByRole("button", { name: "Sign out" }).click();
    await heading("Sign in to GPUaaS");
    await signIn(ADMIN);
    await page.getByRole("navigation", { name: "Operator" }).getByRole("link", { name: "Capacity" }).click();
    await heading("Capacity");
    const id = await page.locator(`figure[data-host-class="${HOST_CLASS}"]`).getAttribute("id");
    await readChart(id);
    result.capacityChart = id;
    const row = page.locator(`#occupancy tr[data-host]`).filter({ has: page.locator(`td[data-allocation]`) });
    result.occupancy = await page.locator("#occupancy tr[data-host]").evaluateAll((rows) =>
      rows.map((r) => ({
        host: r.dataset.host,
        gpus: [...r.querySelectorAll("td[data-gpu]")].map((c) => ({ index: Number(c.dataset.gpu), allocation: c.dataset.allocation ?? null })),
      })),
    );
    await row.first().waitFor();
    await checkA11y("capacity");
    await shot("operator-capacity");
    const occ = page.locator("#occupancy");
    const path = join(SHOTS, "chart-occupancy.png");
    await occ.screenshot({ path });
    result.charts.occupancy = { screenshot: path };
  });
});
