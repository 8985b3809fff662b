import "@xterm/xterm/css/xterm.css";
import "./style.css";
import { describe, logout, onSignedOut, signedIn } from "./api";
import { type Context, loadContext, resetContext, selectProject } from "./context";
import { clear, h } from "./dom";
import { type Cleanup, go, setRenderer } from "./nav";
import { allocationDetail, allocationList, allocationNew } from "./pages/allocations";
import { appCatalog, deployWizard, instanceDetail, instanceList, reopenApp } from "./pages/apps";
import { billing } from "./pages/billing";
import { completeSsoReturn, loginPage } from "./pages/login";
import { auditLog, deadLetters, entitlements, hosts, artifacts } from "./pages/operator";
import { keysAndVolumes } from "./pages/resources";
import { terminalPage } from "./pages/terminal";

export type Page = (main: HTMLElement, params: string[], ctx: Context) => Promise<Cleanup | void>;

const routes: Array<[RegExp, Page, string]> = [
  [/^\/allocations$/, allocationList, "Allocations"],
  [/^\/allocations\/new$/, allocationNew, "New allocation"],
  [/^\/allocations\/([\w-]+)$/, allocationDetail, "Allocation"],
  [/^\/allocations\/([\w-]+)\/terminal$/, terminalPage, "Terminal"],
  [/^\/keys$/, keysAndVolumes, "SSH keys and volumes"],
  [/^\/apps$/, appCatalog, "App catalog"],
  [/^\/apps\/([\w.-]+)\/deploy$/, deployWizard, "Deploy"],
  [/^\/instances$/, instanceList, "App instances"],
  [/^\/instances\/([\w-]+)$/, instanceDetail, "App instance"],
  [/^\/instances\/([\w-]+)\/reopen(?:\?.*)?$/, reopenApp, "Reopening app"],
  [/^\/billing$/, billing, "Billing"],
  [/^\/admin\/hosts$/, hosts, "Hosts"],
  [/^\/queues(?:\?.*)?$/, (main, _p, ctx) => import("./pages/queues").then((m) => m.queuesPage(main, ctx)), "Capacity queues"],
  [/^\/admin\/capacity(?:\?.*)?$/, (main) => import("./pages/capacity").then((m) => m.capacityPage(main)), "Capacity"],
  [/^\/admin\/artifacts$/, artifacts, "Artifacts and promotions"],
  [/^\/admin\/entitlements$/, entitlements, "Entitlements"],
  [/^\/admin\/dead-letters$/, deadLetters, "Dead letters"],
  [/^\/admin\/audit$/, auditLog, "Audit log"],
];

const app = document.getElementById("app")!;
let cleanup: Cleanup | void;
let rendering = 0;

function nav(ctx: Context): HTMLElement {
  const link = (path: string, label: string) =>
    h("a", { href: `#${path}`, "aria-current": location.hash.startsWith(`#${path}`) ? "page" : null }, label);
  const tenantLinks = [
    link("/allocations", "Allocations"),
    link("/apps", "App catalog"),
    link("/instances", "Instances"),
    link("/keys", "SSH keys & volumes"),
    link("/billing", "Billing"),
    // tenant admins read their tenant's audit log: theirs, not an operator's page
    // tenant admins see their tenant's and projects' capacity queues (operators: in their menu)
    !ctx.operator && ctx.tenantAdminOf.size ? link("/queues", "Queues") : null,
    !ctx.operator && ctx.tenantAdminOf.size ? link("/admin/audit", "Audit log") : null,
  ].filter((l): l is HTMLAnchorElement => l !== null);
  // Operator navigation only for operators (platform admins).
  const opLinks = ctx.operator
    ? [
        link("/admin/hosts", "Hosts"),
        link("/admin/capacity", "Capacity"),
        link("/queues", "Queues"),
        link("/admin/artifacts", "Artifacts"),
        link("/admin/entitlements", "Entitlements"),
        link("/admin/dead-letters", "Dead letters"),
        link("/admin/audit", "Audit log"),
      ]
    : [];
  const picker = h(
    "select",
    {
      id: "project-picker",
      "aria-label": "Project",
      onchange: (e: Event) => {
        selectProject((e.target as HTMLSelectElement).value);
        void render();
      },
    },
    ctx.projects.map((p) =>
      h("option", { value: p.project_id, selected: p.project_id === ctx.project?.project_id }, p.tenant ? `${p.tenant} / ${p.name}` : p.name),
    ),
  );
  return h(
    "header",
    { class: "top" },
    h("a", { class: "brand", href: "#/allocations" }, "GPUaaS"),
    h("nav", { "aria-label": "Main" }, h("ul", null, tenantLinks.map((l) => h("li", null, l)))),
    opLinks.length ? h("nav", { "aria-label": "Operator" }, h("ul", { class: "op" }, opLinks.map((l) => h("li", null, l)))) : null,
    h(
      "div",
      { class: "who" },
      ctx.projects.length ? picker : h("span", { class: "muted" }, "no project"),
      h("span", { class: "user", title: ctx.me.user_id }, ctx.me.email, ctx.operator ? " (operator)" : ""),
      h(
        "button",
        {
          type: "button",
          class: "secondary",
          onclick: async () => {
            await logout();
          },
        },
        "Sign out",
      ),
    ),
  );
}

async function render(): Promise<void> {
  const ticket = ++rendering;
  if (typeof cleanup === "function") cleanup();
  cleanup = undefined;
  const path = location.hash.replace(/^#/, "") || "/allocations";
  if (!signedIn()) {
    resetContext();
    const main = h("main", { id: "main", class: "narrow" });
    clear(app, main);
    document.title = "Sign in · GPUaaS";
    await loginPage(main);
    return;
  }
  let ctx: Context;
  try {
    ctx = await loadContext();
  } catch (err) {
    clear(app, h("main", { id: "main" }, h("p", { role: "alert" }, `Could not load your account: ${describe(err)}`)));
    return;
  }
  if (ticket !== rendering) return;
  if (path === "/login" || path === "/") {
    go("/allocations");
    return;
  }
  const main = h("main", { id: "main", tabindex: "-1" });
  clear(app, nav(ctx), main);
  for (const [re, page, title] of routes) {
    const m = re.exec(path);
    if (!m) continue;
    document.title = `${title} · GPUaaS`;
    try {
      cleanup = await page(main, m.slice(1), ctx);
    } catch (err) {
      main.append(h("p", { role: "alert", class: "error" }, describe(err)));
    }
    return;
  }
  main.append(h("h1", null, "Not found"), h("p", null, h("a", { href: "#/allocations" }, "Back to allocations")));
}

setRenderer(() => void render());
onSignedOut(() => {
  resetContext();
  go("/login");
  void render();
});
window.addEventListener("hashchange", () => void render());
void completeSsoReturn().finally(() => void render());
