// Shared by the browser tests: Debian's Chromium headless (fresh profile) driven by playwright-core, with
// steps, screenshots, an accessibility check, and console errors collected (any unexpected one fails).
//
// Every script prints one JSON line {ok, steps, screenshots, consoleErrors, error, ...} and exits 1 on
// any failure.
import { mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { chromium } from "playwright-core";

export const env = (name, fallback) => {
  const v = process.env[name] ?? fallback;
  if (v === undefined) throw new Error(`${name} is not set`);
  return v;
};

export async function openBrowser() {
  const shots = env("SCREENSHOT_DIR", join(tmpdir(), "gpuaas-console-shots"));
  const timeout = Number(env("STEP_TIMEOUT_MS", "120000"));
  const prefix = env("SCREENSHOT_PREFIX", "");
  mkdirSync(shots, { recursive: true });
  const steps = [];
  const screenshots = [];
  const consoleErrors = [];
  // Chromium aborts in-flight requests with ERR_NETWORK_CHANGED whenever the host's interfaces change, and
  // the tests' own stack creates podman bridges and veths while a page is open. The console retries such a
  // read (api.ts raw); the events are recorded apart, and a step that did not recover still fails.
  const networkChanges = [];
  const b = { expected: [] }; // regexes of console errors the current step causes on purpose (e.g. a 401)

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
  page.setDefaultTimeout(timeout);
  page.on("console", (msg) => {
    if (msg.type() !== "error") return;
    const text = msg.text();
    if (b.expected.some((re) => re.test(text))) return;
    if (/net::ERR_NETWORK_CHANGED/.test(text)) return void networkChanges.push({ url: page.url(), text });
    consoleErrors.push({ url: page.url(), text });
  });
  page.on("pageerror", (err) => consoleErrors.push({ url: page.url(), text: `uncaught: ${err.message}` }));

  async function shot(name) {
    const n = String(screenshots.length + 1).padStart(2, "0");
    const file = join(shots, `${prefix}${n}-${name.replace(/[^\w-]+/g, "-")}.png`);
    await page.screenshot({ path: file, fullPage: true });
    screenshots.push(file);
  }

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
      b.expected = [];
    }
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

  /** Wait until the text of `selector` matches `re`. */
  async function waitText(selector, re, ms = timeout) {
    await page.waitForFunction(
      ([sel, src]) => new RegExp(src).test(document.querySelector(sel)?.textContent ?? ""),
      [selector, re.source],
      { timeout: ms, polling: 250 },
    );
  }

  /** Run the scenario, then print the result line and exit (1 on a failure or an unexpected console error). */
  async function run(result, scenario) {
    Object.assign(result, { ok: false, steps, screenshots, consoleErrors, networkChanges });
    try {
      await scenario();
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
  }

  return Object.assign(b, { page, timeout, step, shot, checkA11y, heading, waitText, run });
}
