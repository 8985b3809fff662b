// The web console in a real headless Chromium (Debian's), against a running stack.
//
//   GATEWAY_URL, USER_EMAIL, USER_PASSWORD, ADMIN_EMAIL, ADMIN_PASSWORD, HOST_CLASS, APP_SLUG,
//   SCREENSHOT_DIR, CHROMIUM (default /usr/bin/chromium)  node tests/console.e2e.mjs
//
// Prints one JSON line {ok, steps, screenshots, consoleErrors, error}; exits 1 on any failure,
// including any console error or uncaught page error that a step did not expect.
import { mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

const env = (name, fallback) => {
  const v = process.env[name] ?? fallback;
  if (v === undefined) throw new Error(`${name} is not set`);
  return v;
};
const BASE = env("GATEWAY_URL").replace(/\/$/, "");
const USER = { email: env("USER_EMAIL"), password: env("USER_PASSWORD") };
const ADMIN = { email: env("ADMIN_EMAIL"), password: env("ADMIN_PASSWORD") };
const HOST_CLASS = env("HOST_CLASS", "");
const APP_SLUG = env("APP_SLUG", "slurm-reference");
const GPU_MODEL = env("GPU_MODEL", "");
const SHOTS = env("SCREENSHOT_DIR", join(tmpdir(), "gpuaas-console-shots"));
const TIMEOUT = Number(env("STEP_TIMEOUT_MS", "120000"));
mkdirSync(SHOTS, { recursive: true });

const steps = [];
const screenshots = [];
const consoleErrors = [];
let expected = []; // regexes of console errors the current step causes on purpose (e.g. a 401)

const profile = mkdtempSync(join(tmpdir(), "gpuaas-chromium-"));
// A fresh profile (user data dir) per run.
const context = await chromium.launchPersistentContext(profile, {
  executablePath: env("CHROMIUM", "/usr/bin/chromium"),
  headless: true,
  args: [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
  ],
  viewport: { width: 1280, height: 860 },
});
const page = context.pages()[0] ?? (await context.newPage());
page.setDefaultTimeout(TIMEOUT);
page.on("console", (msg) => {
  if (msg.type() !== "error") return;
  const text = msg.text();
  if (expected.some((re) => re.test(text))) return;
  consoleErrors.push({ url: page.url(), text });
});
page.on("pageerror", (err) => consoleErrors.push({ url: page.url(), text: `uncaught: ${err.message}` }));

async function step(name, fn) {
  const started = Date.now();
  try {
    await fn();
    steps.push({ name, ok: true, ms: Date.now() - started });
  } catch (err) {
    steps.push({ name, ok: false, ms: Date.now() - started, error: String(err?.message ?? err).slice(0, 2000) });
    await shot(`failed-${name}`).catch(() => null);
    throw err;
  } finally {
    expected = [];
  }
}

async function shot(name) {
  const file = join(SHOTS, `${String(screenshots.length + 1).padStart(2, "0")}-${name.replace(/[^\w-]+/g, "-")}.png`);
  await page.screenshot({ path: file, fullPage: true });
  screenshots.push(file);
}

/** Every form control on the page has an accessible name; the page has one h1 and a main landmark. */
async function checkA11y(label) {
  const problems = await page.evaluate(() => {
    const out = [];
    for (const el of document.querySelectorAll("input:not([type=hidden]), select, textarea, button")) {
      if (el.closest(".xterm")) continue; // xterm's helper textarea is labelled by the terminal itself
      const named =
        el.getAttribute("aria-label") ||
        el.getAttribute("aria-labelledby") ||
        (el.id && document.querySelector(`label[for="${el.id}"]`)) ||
        el.closest("label") ||
        (el.tagName === "BUTTON" && el.textContent.trim());
      if (!named) out.push(`${el.tagName.toLowerCase()}[name=${el.getAttribute("name")}] has no label`);
    }
    if (!document.querySelector("main")) out.push("no <main> landmark");
    if (document.querySelectorAll("h1").length !== 1) out.push(`${document.querySelectorAll("h1").length} h1 elements`);
    return out;
  });
  if (problems.length) throw new Error(`accessibility (${label}): ${problems.join("; ")}`);
}

async function heading(text) {
  await page.getByRole("heading", { level: 1, name: text }).waitFor();
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

async function waitText(locator, re, timeout = TIMEOUT) {
  await page.waitForFunction(
    ([sel, src]) => new RegExp(src).test(document.querySelector(sel)?.textContent ?? ""),
    [locator, re.source],
    { timeout, polling: 250 },
  );
}

const result = { ok: false, steps, screenshots, consoleErrors, allocation: null, instance: null, cost: null };
try {
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
    expected = [/status of 401/];
    await page.getByLabel("Password").fill("wrong-password-123");
    await page.getByRole("button", { name: "Sign in" }).click();
    await page.getByRole("alert").filter({ hasText: "Wrong email or password" }).waitFor();
    await shot("login-inline-error");
  });

  await step("personal tab: sign in", async () => {
    await signIn(USER);
    await checkA11y("allocations");
    await shot("allocations-empty");
  });

  await step("session kept across a reload", async () => {
    await page.reload();
    await heading("Allocations");
    await page.getByText(USER.email).waitFor();
  });

  await step("create an allocation", async () => {
    await page.getByRole("link", { name: "New allocation" }).click();
    await heading("New allocation");
    await checkA11y("new allocation");
    await page.getByLabel("Name", { exact: true }).fill("browser-e2e");
    await page.getByLabel("GPUs").fill("1");
    if (GPU_MODEL) await page.getByLabel("GPU model").fill(GPU_MODEL);
    if (HOST_CLASS) await page.getByLabel("Host class").fill(HOST_CLASS);
    await shot("allocation-create");
    await page.getByRole("button", { name: "Create allocation" }).click();
    await heading("browser-e2e");
    result.allocation = page.url().split("/").pop();
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

  await step("browser terminal runs a command", async () => {
    await page.getByRole("link", { name: "Open terminal" }).click();
    await waitText("#terminal-status", /Connected/);
    await page.locator("#terminal").click();
    await page.keyboard.type("echo console-$((6*7))-ok\n");
    await waitText(".xterm-rows", /console-42-ok/, 30000);
    await shot("terminal");
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
    await page.locator("#instance-events li").first().waitFor();
    await checkA11y("instance");
    await shot("instance-running");
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
    await visit("/admin/artifacts", "Artifacts and promotions", "operator-artifacts");
    await visit("/admin/entitlements", "Entitlements", "operator-entitlements");
    await visit("/admin/dead-letters", "Dead letters", "operator-dead-letters");
    await visit("/admin/audit", "Audit log", "operator-audit");
    await page.locator("table tbody tr").first().waitFor();
    await visit("/billing", "Billing", "operator-billing");
    await page.getByRole("heading", { name: /Operator breakdown/ }).waitFor();
    await signOut();
  });

  if (consoleErrors.length) throw new Error(`console errors: ${JSON.stringify(consoleErrors).slice(0, 2000)}`);
  result.ok = true;
} catch (err) {
  result.error = String(err?.message ?? err).slice(0, 3000);
} finally {
  await context.close().catch(() => null);
  rmSync(profile, { recursive: true, force: true });
}
console.log(JSON.stringify(result));
process.exit(result.ok ? 0 : 1);
