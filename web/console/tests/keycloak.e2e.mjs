// Single sign-on from the console through a real Keycloak in headless Chromium: the Work account tab
// discovers the organisation, the browser goes to Keycloak's own login page (its realm's theme), signs
// in, comes back to the console with a single-use login code that the console exchanges, and lands
// signed in. Then a user whose email Keycloak has not verified comes back refused, the error inline.
//
//   GATEWAY_URL, KEYCLOAK_URL, SSO_EMAIL, SSO_PASSWORD, REFUSED_EMAIL, IDP_NAME, SCREENSHOT_DIR, CHROMIUM
//     node tests/keycloak.e2e.mjs
import { env, openBrowser } from "./browser.mjs";

const BASE = env("GATEWAY_URL").replace(/\/$/, "");
const KEYCLOAK = env("KEYCLOAK_URL").replace(/\/$/, "");
const EMAIL = env("SSO_EMAIL");
const PASSWORD = env("SSO_PASSWORD");
const REFUSED = env("REFUSED_EMAIL");
const IDP_NAME = env("IDP_NAME");

const b = await openBrowser();
const { page, step, shot, heading } = b;
const result = { landed: null };

async function signInAtKeycloak(email) {
  await page.goto(BASE + "/");
  await heading("Sign in to GPUaaS");
  await page.getByRole("tab", { name: "Work account" }).click();
  await page.getByLabel("Work email").fill(email);
  await page.getByRole("button", { name: "Continue" }).click();
  await page.getByRole("link", { name: `Continue with ${IDP_NAME}` }).click();
  await page.locator("#kc-form-login").waitFor();
  if (!page.url().startsWith(KEYCLOAK + "/realms/")) throw new Error(`not at Keycloak: ${page.url()}`);
  if ((await page.locator("#username").inputValue()) !== email) throw new Error("Keycloak's form lacks the login hint");
  await shot("keycloak-form");
  await page.locator("#password").fill(PASSWORD);
  await page.locator("#kc-login").click();
}

await b.run(result, async () => {
  await step("sign in at Keycloak and land signed in", async () => {
    await signInAtKeycloak(EMAIL);
    await heading("Allocations");
    await page.locator(".who .user").filter({ hasText: EMAIL }).waitFor();
    const url = new URL(page.url());
    if (url.search || url.href.includes("login_code")) throw new Error(`the login code stayed in the URL: ${url.href}`);
    result.landed = url.href;
    result.session = await page.evaluate(() => JSON.parse(localStorage.getItem("gpuaas.session") ?? "null"));
    await shot("keycloak-signed-in");
  });

  await step("sign out", async () => {
    await page.getByRole("button", { name: "Sign out" }).click();
    await heading("Sign in to GPUaaS");
  });

  await step("an unverified email comes back refused", async () => {
    // Signing out of the console does not end the Keycloak session: without this, Keycloak would sign
    // the previous user in again without showing its form.
    await page.context().clearCookies();
    await signInAtKeycloak(REFUSED);
    await heading("Sign in to GPUaaS");
    const alert = page.getByRole("alert").filter({ hasText: "email_not_verified" });
    await alert.waitFor();
    result.refusal = (await alert.textContent())?.trim();
    if (await page.evaluate(() => localStorage.getItem("gpuaas.session"))) throw new Error("signed in after a refusal");
    await shot("keycloak-refused");
  });
});
