// Single sign-on from the console in a real headless Chromium: the Work account tab discovers the
// organisation, the browser goes to the enterprise IdP (another identity process) and signs in on its
// form, comes back to the console with a single-use login code that the console exchanges; the user
// lands signed in and the code is gone from the address bar. Then a refused sign-in (the IdP did not
// verify the email) comes back with its error shown inline on the login page. The login code is bound
// to this browser (RFC 7636): the start carries an S256 challenge, the exchange the verifier whose SHA-256
// it is, and the verifier is gone from sessionStorage afterwards.
//
//   GATEWAY_URL, SSO_EMAIL, SSO_PASSWORD, REFUSED_EMAIL, IDP_NAME, SCREENSHOT_DIR, CHROMIUM
//     node tests/sso.e2e.mjs
import { createHash } from "node:crypto";
import { env, openBrowser } from "./browser.mjs";

const BASE = env("GATEWAY_URL").replace(/\/$/, "");
const EMAIL = env("SSO_EMAIL");
const PASSWORD = env("SSO_PASSWORD");
const REFUSED = env("REFUSED_EMAIL");
const IDP_NAME = env("IDP_NAME");

const b = await openBrowser();
const { page, step, shot, checkA11y, heading } = b;
const result = { landed: null };

// The SSO start (a navigation to the gateway) and the login code exchange, as the browser sent them.
const seen = { start: null, exchange: null };
page.on("request", (req) => {
  if (req.url().includes("/api/identity/auth/sso/start?")) seen.start = new URL(req.url());
  if (req.url().endsWith("/api/identity/auth/token") && (req.postData() ?? "").includes("sso_login_code")) {
    seen.exchange = new URLSearchParams(req.postData());
  }
});

async function ssoThroughIdp(email) {
  await page.goto(BASE + "/");
  await heading("Sign in to GPUaaS");
  await page.getByRole("tab", { name: "Work account" }).click();
  await page.getByLabel("Work email").fill(email);
  await page.getByRole("button", { name: "Continue" }).click();
  await page.getByText(/^Work account of /).waitFor();
  await page.getByRole("link", { name: `Continue with ${IDP_NAME}` }).click();
  // The enterprise IdP's own login form (another origin); the email comes as the login hint.
  await page.getByRole("heading", { level: 1, name: "Sign in", exact: true }).waitFor();
  if (!page.url().includes("/oauth/authorize")) throw new Error(`not at the IdP: ${page.url()}`);
  if ((await page.getByLabel("Email").inputValue()) !== email) throw new Error("the IdP form lacks the login hint");
  await shot("sso-idp-form");
  await page.getByLabel("Password").fill(PASSWORD);
  await page.getByRole("button", { name: "Sign in" }).click();
}

await b.run(result, async () => {
  await step("work tab discovers the organisation's IdP", async () => {
    await page.goto(BASE + "/");
    await heading("Sign in to GPUaaS");
    await page.getByRole("tab", { name: "Work account" }).click();
    await page.getByLabel("Work email").fill(EMAIL);
    await page.getByRole("button", { name: "Continue" }).click();
    await page.getByRole("link", { name: `Continue with ${IDP_NAME}` }).waitFor();
    await checkA11y("sso discovery");
    await shot("sso-discovery");
  });

  await step("sign in at the IdP and land signed in", async () => {
    await ssoThroughIdp(EMAIL);
    await heading("Allocations");
    await page.locator(".who .user").filter({ hasText: EMAIL }).waitFor();
    const url = new URL(page.url());
    if (url.search || url.href.includes("login_code")) throw new Error(`the login code stayed in the URL: ${url.href}`);
    if (url.hash !== "#/allocations") throw new Error(`landed at ${url.href}`);
    result.landed = url.href;
    const challenge = seen.start?.searchParams.get("code_challenge");
    const verifier = seen.exchange?.get("code_verifier");
    if (seen.start?.searchParams.get("code_challenge_method") !== "S256") throw new Error(`start: ${seen.start}`);
    if (!verifier || !/^[A-Za-z0-9_-]{43,128}$/.test(verifier)) throw new Error(`exchange verifier: ${verifier}`);
    if (createHash("sha256").update(verifier).digest("base64url") !== challenge) {
      throw new Error(`the exchanged verifier is not the one the start's challenge ${challenge} was made of`);
    }
    if (seen.start.href.includes(verifier)) throw new Error("the verifier left the browser at the start");
    if (await page.evaluate(() => sessionStorage.getItem("gpuaas.sso-pending"))) throw new Error("the verifier was kept");
    result.pkce = { challenge_method: "S256", verifier_length: verifier.length };
    await checkA11y("signed in through sso");
    await shot("sso-signed-in");
  });

  await step("the session survives a reload", async () => {
    await page.reload();
    await heading("Allocations");
    await page.locator(".who .user").filter({ hasText: EMAIL }).waitFor();
    result.session = await page.evaluate(() => JSON.parse(localStorage.getItem("gpuaas.session") ?? "null"));
  });

  await step("sign out", async () => {
    await page.getByRole("button", { name: "Sign out" }).click();
    await heading("Sign in to GPUaaS");
  });

  await step("a refused sign-in comes back with an inline error", async () => {
    await ssoThroughIdp(REFUSED);
    await heading("Sign in to GPUaaS");
    const alert = page.getByRole("alert").filter({ hasText: "email_not_verified" });
    await alert.waitFor();
    result.refusal = (await alert.textContent())?.trim();
    if (new URL(page.url()).search) throw new Error(`the error stayed in the URL: ${page.url()}`);
    if (await page.evaluate(() => localStorage.getItem("gpuaas.session"))) throw new Error("signed in after a refusal");
    await shot("sso-refused");
  });
});
