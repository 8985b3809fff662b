// JupyterLab (a launchable app) in a real headless Chromium, opened through the platform's gateway only:
// `/apps/<instance>/?access_token=<the signed-in user's token>` (what the console's Open button does), then a
// notebook from the launcher, a cell that computes a value, and its output read back.
//
//   GATEWAY_URL, INSTANCE_ID, ACCESS_TOKEN, SCREENSHOT_DIR, CHROMIUM  node tests/jupyter.e2e.mjs
//
// With USER_EMAIL and USER_PASSWORD (the same user): the app cookie is then replaced by an expired one, as the
// token's 15 minutes leave it; loading the app goes through the console's sign-in and back to the same page,
// and once the console is signed in, straight back.
//
// With APPS_DOMAIN (the gateway's GPUAAS_GATEWAY_APPS_DOMAIN): the app must come up on its own origin,
// `<instance>.<APPS_DOMAIN>`, where the console's session (localStorage) is out of its reach.
//
// Prints one JSON line {ok, steps, screenshots, consoleErrors, output, runAttempts, jupyterConsole, ...}.
// JupyterLab's own console messages (e.g. its extension manager's) are reported in `jupyterConsole`, and its
// own error answers in `appErrors`, not failed on; any request the gateway refuses fails the run.
import { env, openBrowser } from "./browser.mjs";

const BASE = env("GATEWAY_URL").replace(/\/$/, "");
const INSTANCE = env("INSTANCE_ID");
const TOKEN = env("ACCESS_TOKEN");
const CELL = env("CELL", "sum(i * i for i in range(10)) * 2");
const EXPECT = env("EXPECT", "570");
const USER_EMAIL = env("USER_EMAIL", "");
const USER_PASSWORD = env("USER_PASSWORD", "");
const APPS_DOMAIN = env("APPS_DOMAIN", "");
let APP = BASE; // the app's origin: the console's, or its own with an apps domain

const b = await openBrowser();
const { page, step, shot } = b;
const result = { jupyterConsole: [], refused: [] };
page.on("console", (msg) => {
  if (msg.type() === "error") result.jupyterConsole.push(msg.text().slice(0, 300));
});
// The gateway's refusals are problem+json; JupyterLab's own 4xx (e.g. a 404 for a kernel it has just shut
// down itself, when a new notebook briefly gets two sessions) are the app's business: noted, not failed on.
result.appErrors = [];
page.on("response", (resp) => {
  const url = resp.url();
  if (url.includes(`/apps/${INSTANCE}/`) && [401, 403, 404, 502].includes(resp.status())) {
    const fromGateway = (resp.headers()["content-type"] ?? "").startsWith("application/problem+json");
    (fromGateway ? result.refused : result.appErrors).push(`${resp.status()} ${url.replace(APP, "")}`);
  }
});

await b.run(result, async () => {
  await step("open the app through the gateway (token exchanged for a cookie)", async () => {
    b.expected = [/./];
    await page.goto(`${BASE}/apps/${INSTANCE}/?access_token=${encodeURIComponent(TOKEN)}`);
    await page.waitForURL(new RegExp(`/apps/${INSTANCE}/lab`), { timeout: b.timeout });
    if (page.url().includes("access_token")) throw new Error(`the token stayed in the URL: ${page.url()}`);
    APP = new URL(page.url()).origin;
    result.appOrigin = APP;
    if (APPS_DOMAIN && new URL(APP).hostname !== `${INSTANCE}.${APPS_DOMAIN}`) {
      throw new Error(`the app is not on its own origin: ${page.url()}`);
    }
    const cookies = await page.context().cookies(`${APP}/apps/${INSTANCE}/`);
    const session = cookies.find((c) => c.name === "gpuaas_app_session");
    if (!session || !session.httpOnly || session.path !== `/apps/${INSTANCE}/`) {
      throw new Error(`no HttpOnly app cookie scoped to the app: ${JSON.stringify(cookies)}`);
    }
    await page.locator(".jp-LauncherCard").first().waitFor();
    await shot("jupyterlab-launcher");
  });
  await step("new notebook from the launcher", async () => {
    b.expected = [/./];
    await page.locator('.jp-LauncherCard[data-category="Notebook"]').first().click();
    await page.locator(".jp-Notebook .jp-Cell .cm-content").first().waitFor();
    // the kernel is connected (its WebSocket through the gateway) once the status says idle
    await page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first().waitFor({ timeout: b.timeout });
  });
  await step("run a cell and read its output", async () => {
    b.expected = [/./];
    const editor = page.locator(".jp-Notebook .jp-Cell .cm-content").first();
    await editor.click();
    await page.keyboard.type(CELL);
    // JupyterLab shows the notebook (and an idle indicator) before its kernel connection is up; a cell run
    // then is skipped silently (the prompt stays "[ ]:", nothing is sent). So run it in place (Ctrl+Enter)
    // until the prompt shows it was taken ("[*]:" queued/running, "[n]:" done): retries are counted.
    result.runAttempts = 0;
    for (;;) {
      result.runAttempts += 1;
      await editor.click();
      await page.keyboard.press("Control+Enter");
      const taken = await page
        .waitForFunction(
          () => /\[(\*|\d+)\]/.test(document.querySelector(".jp-Notebook .jp-Cell .jp-InputPrompt")?.textContent ?? ""),
          null,
          { timeout: 15000 },
        )
        .then(() => true, () => false);
      if (taken) break;
      if (result.runAttempts >= 6) throw new Error("the cell was never taken by the kernel (prompt stayed [ ])");
    }
    const out = page.locator(".jp-OutputArea-output").first();
    await out.waitFor();
    await page.waitForFunction(
      (want) => (document.querySelector(".jp-OutputArea-output")?.textContent ?? "").includes(want),
      EXPECT,
      { timeout: b.timeout },
    );
    result.output = (await out.textContent()).trim();
    await shot("jupyterlab-cell-output");
  });
  if (USER_EMAIL) {
    const appCookie = async () =>
      (await page.context().cookies(`${APP}/apps/${INSTANCE}/`)).find((c) => c.name === "gpuaas_app_session");
    const expire = async () => {
      await page.goto("about:blank"); // JupyterLab's own polling would meet the expired cookie first
      const { hostname } = new URL(APP);
      const stale = { name: "gpuaas_app_session", value: "expired", domain: hostname, path: `/apps/${INSTANCE}/` };
      await page.context().addCookies([{ ...stale, httpOnly: true, sameSite: "Lax" }]);
    };
    const backInLab = async () => {
      // (JupyterLab may rewrite its own URL once loaded; the token must be gone from it either way)
      await page.waitForURL((u) => u.pathname.startsWith(`/apps/${INSTANCE}/lab`) && !u.search.includes("access_token"), {
        timeout: b.timeout,
      });
      await page.locator("#jp-main-dock-panel").waitFor();
      if (new URL(page.url()).origin !== APP) throw new Error(`back on another origin: ${page.url()}`);
      const cookie = await appCookie();
      if (!cookie || cookie.value === "expired") throw new Error("no fresh app cookie after the reopen");
      // The console is signed in now (its session in its origin's localStorage): the app's pages see none of it.
      const seen = await page.evaluate(() => Object.keys(localStorage).filter((k) => k.startsWith("gpuaas.")));
      result.consoleStorageSeenByApp = seen;
      if (APPS_DOMAIN && seen.length) throw new Error(`the app's page reads the console's storage: ${seen}`);
    };
    await step("an expired app session goes through the console sign-in and back", async () => {
      b.expected = [/./];
      await expire();
      await page.goto(`${APP}/apps/${INSTANCE}/lab?from=reopen`);
      await page.getByRole("heading", { level: 1, name: "Sign in to GPUaaS" }).waitFor();
      if (!page.url().includes(`#/instances/${INSTANCE}/reopen?`)) throw new Error(`not the reopen route: ${page.url()}`);
      await page.getByRole("tab", { name: "Personal account" }).click();
      await page.getByLabel("Email", { exact: true }).fill(USER_EMAIL);
      await page.getByLabel("Password").fill(USER_PASSWORD);
      await page.getByRole("button", { name: "Sign in" }).click();
      await backInLab();
      await shot("jupyterlab-reopened-after-sign-in");
    });
    await step("with the console signed in, straight back", async () => {
      b.expected = [/./];
      await expire();
      await page.goto(`${APP}/apps/${INSTANCE}/lab?from=reopen`);
      await backInLab();
      result.reopened = true;
    });
  }
  if (result.refused.length) throw new Error(`the gateway refused requests: ${result.refused.join(", ")}`);
});
