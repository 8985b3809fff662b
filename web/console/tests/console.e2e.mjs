// The web console in a real headless Chromium (Debian's), against a running stack.
//
//   GATEWAY_URL, USER_EMAIL, USER_PASSWORD, ADMIN_EMAIL, ADMIN_PASSWORD, HOST_CLASS, APP_SLUG,
//   SCREENSHOT_DIR, CHROMIUM (default /usr/bin/chromium), TENANT_ID, HOST_GPUS  node tests/console.e2e.mjs
//
// Prints one JSON line {ok, steps, screenshots, consoleErrors, error}; exits 1 on any failure,
// including any console error or uncaught page error that a step did not expect.
import { env, openBrowser } from "./browser.mjs";

const BASE = env("GATEWAY_URL").replace(/\/$/, "");
const USER = { email: env("USER_EMAIL"), password: env("USER_PASSWORD") };
const ADMIN = { email: env("ADMIN_EMAIL"), password: env("ADMIN_PASSWORD") };
const HOST_CLASS = env("HOST_CLASS", "");
const APP_SLUG = env("APP_SLUG", "slurm-reference");
const GPU_MODEL = env("GPU_MODEL", "");
const MEMBER = { userId: env("MEMBER_USER_ID"), publicKey: env("MEMBER_PUBLIC_KEY") };
const BUDGET_NAME = env("BUDGET_NAME");
// The tenant of USER (its capacity queue is on the operator's queue page) and how many GPUs the host has (a
// request for all of them, made while the first allocation holds two, waits in the queue).
const TENANT_ID = env("TENANT_ID", "");
const HOST_GPUS = Number(env("HOST_GPUS", "4"));
// The runtime the first allocation is created from (slug@version, picked in the form) and what its page must
// then show; empty: the form's default and no runtime checks.
const RUNTIME = env("RUNTIME", "");
const RUNTIME_DIGEST = env("RUNTIME_DIGEST", "");
const EXPECT_DRIVER = env("EXPECT_DRIVER", "");

const b = await openBrowser();
const { page, step, shot, checkA11y, heading, waitText } = b;
const TIMEOUT = b.timeout;

/** Create a `gpus`-GPU allocation through the form (on `runtime`, slug@version, when given); its id. */
async function createAllocation(name, screenshots, runtime = "", gpus = 1) {
  await page.goto(`${BASE}/#/allocations`);
  await heading("Allocations");
  await page.getByRole("link", { name: "New allocation" }).click();
  await heading("New allocation");
  await checkA11y("new allocation");
  await page.getByLabel("Name", { exact: true }).fill(name);
  await page.getByLabel("GPUs").fill(String(gpus));
  if (GPU_MODEL) await page.getByLabel("GPU model").fill(GPU_MODEL);
  if (HOST_CLASS) await page.getByLabel("Host class").fill(HOST_CLASS);
  if (runtime) {
    await page.getByLabel("Runtime image").selectOption(runtime);
    await waitText("#runtime-digest", /Pinned by digest: sha256:[0-9a-f]{64}/);
  }
  if (screenshots) await shot("allocation-create");
  await page.getByRole("button", { name: "Create allocation" }).click();
  await heading(name);
  return page.url().split("/").pop();
}

/** Click an allocation action, see the console acknowledge it, then its live timeline entry succeed. */
async function actAndSettle(button, what, phase) {
  const done = `#timeline li[data-phase="${phase}"][data-status="succeeded"]`;
  const before = await page.locator(done).count();
  await button.click();
  await page.getByRole("status").filter({ hasText: `${what}: requested.` }).waitFor();
  await page.waitForFunction(([sel, n]) => document.querySelectorAll(sel).length > n, [done, before], { timeout: TIMEOUT });
  await waitText("#alloc-status", /^active$/);
}

async function visit(hash, h1, name) {
  await page.goto(`${BASE}/#${hash}`);
  await heading(h1);
  await page.waitForLoadState("networkidle").catch(() => null);
  await checkA11y(name);
  await shot(name);
}

async function signIn(who) {
  await page.getByRole("tab", { name: "Personal account" }).click();
  await page.getByLabel("Email", { exact: true }).fill(who.email);
  await page.getByLabel("Password").fill(who.password);
  await page.getByRole("button", { name: "Sign in" }).click();
  await heading("Allocations");
}

async function signOut() {
  await page.getByRole("button", { name: "Sign out" }).click();
  await heading("Sign in to GPUaaS");
}

const result = { allocation: null, instance: null, cost: null };
await b.run(result, async () => {
  await step("login page", async () => {
    await page.goto(BASE + "/");
    await heading("Sign in to GPUaaS");
    await page.getByRole("tab", { name: "Work account" }).click();
    await checkA11y("login");
    await shot("login-work-tab");
  });

  await step("work tab: discovery and an inline error", async () => {
    await page.getByLabel("Work email").fill("not-an-email");
    await page.getByRole("button", { name: "Continue" }).click();
    await page.getByRole("alert").filter({ hasText: "valid email" }).waitFor();
    await page.getByLabel("Work email").fill(USER.email);
    await page.getByRole("button", { name: "Continue" }).click();
    await page.getByText("No single sign-on is set up").waitFor();
    b.expected = [/status of 401/];
    await page.getByLabel("Password").fill("wrong-password-123");
    await page.getByRole("button", { name: "Sign in" }).click();
    await page.getByRole("alert").filter({ hasText: "Wrong email or password" }).waitFor();
    await shot("login-inline-error");
  });

  await step("personal tab: sign in", async () => {
    await signIn(USER);
    // Operator navigation only for operators (issue 21).
    if (await page.getByRole("navigation", { name: "Operator" }).count()) throw new Error("a tenant sees the operator menu");
    await checkA11y("allocations");
    await shot("allocations-empty");
  });

  await step("session kept across a reload", async () => {
    await page.reload();
    await heading("Allocations");
    await page.getByText(USER.email).waitFor();
  });

  await step("create an allocation", async () => {
    result.allocation = await createAllocation("browser-e2e", true, RUNTIME);
  });

  await step("timeline reaches active (live)", async () => {
    await waitText("#alloc-status", /^active$/);
    await page.locator("#timeline li").first().waitFor();
    const phases = await page.locator("#timeline li .phase").allTextContents();
    if (phases.length < 2) throw new Error(`timeline has ${phases.length} entries: ${phases}`);
    result.timeline = phases;
    await checkA11y("allocation detail");
    await shot("allocation-active");
  });

  if (RUNTIME) {
    await step("the allocation shows its runtime, digest, driver and limits", async () => {
      const [slug, version] = RUNTIME.split("@");
      await waitText("#alloc-runtime", new RegExp(`^${slug} ${version.replace(/\./g, "\\.")}$`));
      await waitText("#alloc-runtime-digest", new RegExp(`^${RUNTIME_DIGEST || "sha256:[0-9a-f]{64}"}$`));
      if (EXPECT_DRIVER) await waitText("#alloc-driver", new RegExp(`^${EXPECT_DRIVER}$`));
      await waitText("#alloc-limits", /^[\d.]+ CPUs, \d+ MB memory, \d+ processes$/);
      result.runtimeShown = (await page.locator("#alloc-runtime").textContent())?.trim();
      result.limitsShown = (await page.locator("#alloc-limits").textContent())?.trim();
      await shot("allocation-runtime");
    });
  }

  await step("browser terminal runs a command", async () => {
    await page.getByRole("link", { name: "Open terminal" }).click();
    await waitText("#terminal-status", /Connected/);
    await page.locator("#terminal").click();
    await page.keyboard.type("echo console-$((6*7))-ok\n");
    await waitText(".xterm-rows", /console-42-ok/, 30000);
    await shot("terminal");
  });

  await step("restart the allocation", async () => {
    await page.goto(`${BASE}/#/allocations/${result.allocation}`);
    await waitText("#alloc-status", /^active$/);
    await actAndSettle(page.getByRole("button", { name: "Restart" }), "Restart", "restart");
    await shot("allocation-restarted");
  });

  await step("resize the allocation to 2 GPUs", async () => {
    await page.getByLabel("New GPU count").fill("2");
    await actAndSettle(page.getByRole("button", { name: "Resize" }), "Resize", "resize");
    await waitText("#alloc-gpus", /^2 × /);
    await shot("allocation-resized");
  });

  await step("a request that does not fit waits: position and reason, then cancelled", async () => {
    // The first allocation holds 2 of the host's GPUs: a request for all of them waits (issue 29).
    result.queued = await createAllocation("browser-queued", false, "", HOST_GPUS);
    await waitText("#alloc-status", /^queued$/);
    await waitText("#alloc-queue-position", /^1$/);
    await page.locator('#alloc-pending-reason[data-reason="no_capacity"]').waitFor();
    await waitText("#alloc-pending-reason", /^no ready host has the requested GPUs free$/);
    await waitText("#alloc-max-wait", /No maximum wait/);
    await page.locator('#timeline li[data-phase="queue"][data-status="started"]').waitFor();
    result.queueNotice = (await page.locator("#alloc-queue").textContent())?.trim();
    await checkA11y("queued allocation");
    await shot("allocation-queued");
    await page.getByRole("button", { name: "Cancel request" }).click();
    await page.getByRole("button", { name: "Confirm cancel request" }).click();
    await waitText("#alloc-status", /^released$/);
    if (await page.locator("#alloc-queue").count()) throw new Error("the queue notice stayed after the cancel");
    await page.goto(`${BASE}/#/allocations/${result.allocation}`);
    await waitText("#alloc-status", /^active$/);
  });

  await step("grant a project member SSH access", async () => {
    const ssh = page.locator("#ssh");
    // The member picker (name and email), not a raw user id (issue 21).
    await ssh.getByLabel("Project member").selectOption(MEMBER.userId);
    await ssh.getByLabel("Their public key").fill(MEMBER.publicKey);
    await ssh.getByRole("button", { name: "Grant access" }).click();
    const row = ssh.locator("table tbody tr").filter({ has: page.locator(`[data-user-id="${MEMBER.userId}"]`) });
    await row.waitFor();
    await row.locator("[data-status=active]").waitFor();
    if ((await row.textContent())?.includes(MEMBER.userId)) throw new Error("the grant shows a raw user id, not the member");
    await checkA11y("allocation with a grant");
    await shot("allocation-ssh-grant");
  });

  await step("create a volume and attach it", async () => {
    await visit("/keys", "SSH keys and volumes", "keys-and-volumes-before");
    await page.getByLabel("Volume name").fill("scratch");
    await page.getByLabel("Size (GB)").fill("20");
    await page.getByRole("button", { name: "Create volume" }).click();
    await page.locator("table tbody tr").filter({ hasText: "scratch" }).waitFor();
    await page.goto(`${BASE}/#/allocations/${result.allocation}`);
    await waitText("#alloc-status", /^active$/);
    const storage = page.locator("#storage");
    await storage.getByLabel("Volume to attach").selectOption({ label: "scratch (20 GB, single_writer)" });
    await storage.getByRole("button", { name: "Attach volume" }).click();
    const row = storage.locator("table tbody tr").filter({ hasText: "scratch" });
    await row.waitFor();
    result.mountPath = ((await row.locator("code").textContent()) ?? "").trim();
    if (!result.mountPath.startsWith("/")) throw new Error(`no mount path for the attached volume: ${result.mountPath}`);
    await checkA11y("allocation with a volume");
    await shot("allocation-volume-attached");
  });

  await step("app catalog", async () => {
    await page.goto(`${BASE}/#/apps`);
    await heading("App catalog");
    const card = page.locator("article.app").filter({ has: page.locator(`#app-${APP_SLUG}`) });
    await card.waitFor();
    await card.locator(".verdict[data-deployable]").waitFor();
    await checkA11y("catalog");
    await shot("catalog");
    await card.getByRole("link", { name: /^Deploy/ }).click();
  });

  await step("deploy wizard collects the manifest inputs", async () => {
    await page.getByRole("heading", { level: 1, name: /^Deploy/ }).waitFor();
    // The app's runtime image is shown before anything is deployed (issue 21).
    await waitText("#deploy-runtime-image", /\S+[@:]\S+/);
    await page.getByLabel("Instance name").fill("console-cluster");
    await page.getByRole("button", { name: "Next" }).click();
    const cluster = page.getByLabel(/cluster_name/);
    await cluster.fill("Not Valid!");
    await page.getByRole("button", { name: "Next" }).click();
    await page.getByRole("alert").filter({ hasText: /cluster_name/ }).waitFor();
    await cluster.fill("console");
    await checkA11y("deploy configuration");
    await shot("deploy-configuration");
    await page.getByRole("button", { name: "Next" }).click();
    await page.getByRole("button", { name: "Next" }).click();
    await page.locator(".review pre").waitFor();
    await shot("deploy-review");
    await page.getByRole("button", { name: "Deploy" }).click();
    await page.locator("#instance-status").waitFor();
    result.instance = page.url().split("/").pop();
  });

  await step("instance becomes running", async () => {
    await waitText("#instance-status", /^running$/);
    // Not a launchable app: no "Open" button (the Jupyter browser test opens a launchable one).
    if (await page.locator("#open-app").count()) throw new Error("an Open button on a non-launchable app");
    await page.locator("#instance-events li").first().waitFor();
    await checkA11y("instance");
    await shot("instance-running");
  });

  await step("a second allocation for a worker", async () => {
    result.worker = await createAllocation("browser-worker", false);
    await waitText("#alloc-status", /^active$/);
    await page.goto(`${BASE}/#/instances/${result.instance}`);
    await waitText("#instance-status", /^running$/);
  });

  await step("add a worker", async () => {
    const members = page.locator("table").filter({ has: page.getByRole("columnheader", { name: "Component" }) }).first();
    await page.getByLabel("Allocation for the new worker").selectOption(result.worker);
    await page.getByRole("button", { name: "Add worker" }).click();
    await page.getByRole("status").filter({ hasText: "Add worker: requested." }).waitFor();
    const row = members.locator("tbody tr").filter({ has: page.locator(`a[href="#/allocations/${result.worker}"]`) });
    await row.waitFor();
    await row.locator("[data-status=active]").waitFor();
    await waitText("#instance-status", /^running$/);
    await shot("instance-worker-added");
  });

  await step("remove the worker", async () => {
    const row = page.locator("tbody tr").filter({ has: page.locator(`a[href="#/allocations/${result.worker}"]`) }).first();
    await row.getByRole("button", { name: "Remove" }).click();
    await page.getByRole("status").filter({ hasText: "Remove: requested." }).waitFor();
    await row.filter({ hasText: "tombstone" }).waitFor();
    await waitText("#instance-status", /^running$/);
    await shot("instance-worker-removed");
  });

  await step("decommission the instance", async () => {
    await page.getByRole("button", { name: "Decommission" }).click();
    await page.getByRole("button", { name: "Confirm decommission" }).click();
    await waitText("#instance-status", /^decommissioned$/);
    await shot("instance-decommissioned");
  });

  await step("release the allocation", async () => {
    await page.goto(`${BASE}/#/allocations/${result.allocation}`);
    await waitText("#alloc-status", /^active$/);
    await page.getByRole("button", { name: "Release" }).click();
    await page.getByRole("button", { name: "Confirm release" }).click();
    await waitText("#alloc-status", /^released$/);
    if (EXPECT_DRIVER === "container") {
      // The host agent's release evidence, each check held.
      await page.locator('#alloc-release-evidence li[data-check="container_removed"][data-ok="true"]').waitFor();
      const failed = await page.locator('#alloc-release-evidence li[data-ok="false"]').count();
      if (failed) throw new Error(`${failed} release check(s) failed: ${await page.locator("#alloc-release-evidence").textContent()}`);
    }
    await shot("allocation-released");
  });

  await step("the cost appears", async () => {
    const deadline = Date.now() + TIMEOUT;
    for (;;) {
      await page.goto(`${BASE}/#/billing`);
      await heading("Billing");
      const text = (await page.locator("#cost-total").textContent()) ?? "";
      const amount = Number((text.match(/[\d.]+/) ?? ["0"])[0]);
      if (amount > 0) {
        result.cost = text.trim();
        break;
      }
      if (Date.now() > deadline) throw new Error(`no cost after release: ${text}`);
      await page.waitForTimeout(2000);
      await page.goto(`${BASE}/#/allocations`);
    }
    await checkA11y("billing");
    await shot("billing");
  });

  await step("other tenant pages", async () => {
    await visit("/instances", "App instances", "instances");
    await visit("/keys", "SSH keys and volumes", "keys-and-volumes");
  });

  await step("responsive: narrow screen", async () => {
    await page.setViewportSize({ width: 390, height: 844 });
    await visit("/allocations", "Allocations", "allocations-mobile");
    const overflow = await page.evaluate(() => document.documentElement.scrollWidth - window.innerWidth);
    if (overflow > 2) throw new Error(`page scrolls sideways by ${overflow}px at 390px`);
    await page.setViewportSize({ width: 1280, height: 860 });
  });

  await step("logout", async () => {
    await signOut();
    await page.reload();
    await heading("Sign in to GPUaaS");
    await shot("signed-out");
  });

  await step("operator pages", async () => {
    await signIn(ADMIN);
    await visit("/admin/hosts", "Hosts", "operator-hosts");
    if (EXPECT_DRIVER) {
      const row = page.locator("table tbody tr").filter({ hasText: HOST_CLASS }).first();
      await row.locator(`[data-driver="${EXPECT_DRIVER}"]`).waitFor();
      if (EXPECT_DRIVER === "container") await row.locator('[data-isolates="true"]').waitFor();
      await page.getByRole("heading", { name: "Host classes" }).waitFor();
    }
    await visit("/admin/capacity", "Capacity", "operator-capacity");
    await page.locator("#occupancy").waitFor();
    // The queue page (issue 29).
    {
      await visit("/queues", "Capacity queues", "operator-queues");
      // The user's tenant has a queue of the pool (weight set by the test) and held GPUs in the last 24 h.
      const row = page.locator(`table.queues[data-gpu-model="${GPU_MODEL}"] tr[data-scope="tenant"][data-scope-id="${TENANT_ID}"]`);
      await row.waitFor();
      const cells = await row.locator("td").allTextContents();
      if (cells[4] !== "2") throw new Error(`the tenant's queue row: ${cells}`);
      const figure = page.locator(`figure[data-gpu-model="${GPU_MODEL}"]`);
      await figure.waitFor();
      const values = JSON.parse((await figure.getAttribute("data-values")) ?? "{}");
      const held = Object.values(values.series ?? {}).flat().filter((v) => v > 0);
      if (!held.length) throw new Error(`no queue held ${GPU_MODEL} GPUs in the chart: ${JSON.stringify(values)}`);
      result.queueShares = Object.keys(values.series);
    }
    await visit("/admin/artifacts", "Artifacts and promotions", "operator-artifacts");
    await visit("/admin/entitlements", "Entitlements", "operator-entitlements");
    await visit("/admin/dead-letters", "Dead letters", "operator-dead-letters");
    await visit("/admin/audit", "Audit log", "operator-audit");
    await page.locator("table tbody tr").first().waitFor();
    await visit("/billing", "Billing", "operator-billing");
    await page.getByRole("heading", { name: /Operator breakdown/ }).waitFor();
  });

  await step("budgets: create one and see it listed", async () => {
    await page.getByLabel("Budget name").fill(BUDGET_NAME);
    await page.getByLabel("Limit").fill("250");
    await page.getByRole("button", { name: "Create budget" }).click();
    const row = page.locator("table tbody tr").filter({ hasText: BUDGET_NAME });
    await row.waitFor();
    if (!/250(\.0+)? USD/.test((await row.textContent()) ?? "")) throw new Error(`budget row: ${await row.textContent()}`);
    await checkA11y("billing with a budget");
    await shot("billing-budget");
    await signOut();
  });
});
