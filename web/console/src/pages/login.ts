import { anonymous, describe, exchangeLoginCode, login, ApiError } from "../api";
import { type Obj } from "../context";
import { clear, field, h } from "../dom";
import { go } from "../nav";

type Tab = "work" | "personal";

// Single sign-on: the browser leaves for the IdP with return_to = this console plus a random value, and
// the S256 challenge of a random PKCE verifier (RFC 7636); both are kept in sessionStorage. The identity
// service sends the browser back with `login_code` (single use) or `error`; only the verifier redeems the
// code, so a code seen in the history or a log is worthless elsewhere.
const SSO_KEY = "gpuaas.sso-pending";
let ssoError: string | null = null;

interface SsoPending {
  nonce: string;
  verifier: string;
}

function base64url(bytes: Uint8Array): string {
  let bin = "";
  for (const b of bytes) bin += String.fromCharCode(b);
  return btoa(bin).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

/** A PKCE code verifier (48 random bytes: 64 base64url characters) and its S256 challenge. */
async function pkcePair(): Promise<{ verifier: string; challenge: string }> {
  const verifier = base64url(crypto.getRandomValues(new Uint8Array(48)));
  const digest = await crypto.subtle.digest("SHA-256", new TextEncoder().encode(verifier));
  return { verifier, challenge: base64url(new Uint8Array(digest)) };
}

async function ssoStart(startUrl: string, email: string): Promise<string> {
  if (!globalThis.isSecureContext || !crypto.subtle) {
    throw new Error("Single sign-on needs this console over HTTPS (or on 127.0.0.1): the browser's crypto is unavailable.");
  }
  const nonce = crypto.randomUUID();
  const { verifier, challenge } = await pkcePair();
  sessionStorage.setItem(SSO_KEY, JSON.stringify({ nonce, verifier } satisfies SsoPending));
  const back = new URL(location.pathname, location.origin);
  back.searchParams.set("sso", nonce);
  const url = new URL(startUrl, location.origin);
  url.searchParams.set("email", email);
  url.searchParams.set("return_to", back.toString());
  url.searchParams.set("code_challenge", challenge);
  url.searchParams.set("code_challenge_method", "S256");
  return url.toString();
}

function ssoPending(): SsoPending | null {
  try {
    const value = JSON.parse(sessionStorage.getItem(SSO_KEY) ?? "null") as Partial<SsoPending> | null;
    return value?.nonce && value.verifier ? { nonce: value.nonce, verifier: value.verifier } : null;
  } catch {
    return null;
  }
}

/** On load: finish an SSO login that came back to the console (exchange the code, store the session),
 * or keep its error for the login page; either way the code and error leave the address bar. */
export async function completeSsoReturn(): Promise<void> {
  const q = new URLSearchParams(location.search);
  if (!q.has("sso")) return;
  const pending = ssoPending();
  sessionStorage.removeItem(SSO_KEY); // the nonce and the verifier serve one return only
  const code = q.get("login_code");
  history.replaceState(null, "", `${location.pathname}#${code && !q.get("error") ? "/allocations" : "/login"}`);
  if (!pending || q.get("sso") !== pending.nonce) {
    ssoError = "This sign-in was not started from this browser: start it again. (sso_state_mismatch)";
  } else if (q.get("error")) {
    ssoError = `Single sign-on failed: ${q.get("error_description") || "the sign-in was refused"} (${q.get("error")})`;
  } else if (code) {
    try {
      await exchangeLoginCode(code, pending.verifier);
    } catch (ex) {
      ssoError = `Single sign-on failed: ${describe(ex)}`;
    }
  }
}

export async function loginPage(main: HTMLElement): Promise<void> {
  let tab: Tab = ssoError ? "work" : (localStorage.getItem("gpuaas.login-tab") as Tab) || "work";
  const panel = h("div", { role: "tabpanel", id: "login-panel" });
  const tabs: Record<Tab, HTMLButtonElement> = {
    work: h("button", { type: "button", role: "tab", id: "tab-work", "aria-controls": "login-panel" }, "Work account"),
    personal: h("button", { type: "button", role: "tab", id: "tab-personal", "aria-controls": "login-panel" }, "Personal account"),
  };
  const show = (t: Tab) => {
    tab = t;
    localStorage.setItem("gpuaas.login-tab", t);
    for (const [name, btn] of Object.entries(tabs)) {
      btn.setAttribute("aria-selected", String(name === t));
      btn.tabIndex = name === t ? 0 : -1;
    }
    panel.setAttribute("aria-labelledby", `tab-${t}`);
    if (t === "work") workForm(panel);
    else passwordForm(panel, "", "Sign in with your email and password.");
  };
  tabs.work.addEventListener("click", () => show("work"));
  tabs.personal.addEventListener("click", () => show("personal"));
  const list = h("div", { role: "tablist", "aria-label": "Account type" }, tabs.work, tabs.personal);
  list.addEventListener("keydown", (e) => {
    if (e.key === "ArrowRight" || e.key === "ArrowLeft") {
      const next: Tab = tab === "work" ? "personal" : "work";
      show(next);
      tabs[next].focus();
    }
  });
  clear(main, h("section", { class: "card login" }, h("h1", null, "Sign in to GPUaaS"), list, panel));
  show(tab);
}

function errorBox(): HTMLElement {
  return h("p", { class: "error", role: "alert", "aria-live": "assertive", hidden: true });
}

function showError(box: HTMLElement, message: string | null): void {
  box.textContent = message ?? "";
  box.hidden = !message;
}

function workForm(panel: HTMLElement): void {
  const email = h("input", { type: "email", name: "email", autocomplete: "username", required: true });
  const err = errorBox();
  if (ssoError) {
    showError(err, ssoError);
    ssoError = null;
  }
  const result = h("div", { class: "discovery", "aria-live": "polite" });
  const form = h(
    "form",
    {
      novalidate: true,
      onsubmit: async (e: Event) => {
        e.preventDefault();
        showError(err, null);
        if (!email.checkValidity()) {
          email.setAttribute("aria-invalid", "true");
          showError(err, "Enter a valid email address.");
          email.focus();
          return;
        }
        email.removeAttribute("aria-invalid");
        try {
          const d = await anonymous<Obj>("/api/identity/auth/discover", { email: email.value });
          showDiscovery(result, d, email.value);
        } catch (ex) {
          showError(err, describe(ex));
        }
      },
    },
    h("p", null, "Enter your work email: we find your organisation and how it signs in."),
    field("Work email", email),
    err,
    h("button", { type: "submit", class: "primary" }, "Continue"),
  );
  clear(panel, form, result);
  email.focus();
}

function showDiscovery(box: HTMLElement, d: Obj, email: string): void {
  if (d.account_type === "work" && d.identity_provider) {
    const idp = d.identity_provider;
    const startErr = errorBox();
    clear(
      box,
      h("p", { class: "found" }, `Work account of ${d.tenant?.name ?? "your organisation"}.`),
      h(
        "a",
        {
          class: "button primary",
          href: idp.sso_start_url,
          id: "sso-start",
          onclick: async (e: Event) => {
            e.preventDefault();
            try {
              location.assign(await ssoStart(idp.sso_start_url, email));
            } catch (ex) {
              showError(startErr, describe(ex));
            }
          },
        },
        `Continue with ${idp.name}`,
      ),
      startErr,
      idp.enforce_sso ? h("p", { class: "muted" }, "Your organisation requires single sign-on.") : null,
    );
    if (!idp.enforce_sso) {
      const sub = h("div");
      box.append(h("p", { class: "muted" }, "Or use your GPUaaS password:"), sub);
      passwordForm(sub, email, null);
    }
    return;
  }
  clear(box, h("p", { class: "found" }, "No single sign-on is set up for this email's domain: sign in with your password."));
  const sub = h("div");
  box.append(sub);
  passwordForm(sub, email, null);
}

function passwordForm(panel: HTMLElement, presetEmail: string, intro: string | null): void {
  const email = h("input", { type: "email", name: "email", autocomplete: "username", required: true, value: presetEmail });
  const password = h("input", { type: "password", name: "password", autocomplete: "current-password", required: true });
  const err = errorBox();
  const submit = h("button", { type: "submit", class: "primary" }, "Sign in");
  const form = h(
    "form",
    {
      novalidate: true,
      onsubmit: async (e: Event) => {
        e.preventDefault();
        showError(err, null);
        for (const input of [email, password]) input.toggleAttribute("aria-invalid", !input.checkValidity());
        if (!email.checkValidity() || !password.value) {
          showError(err, !email.checkValidity() ? "Enter a valid email address." : "Enter your password.");
          return;
        }
        submit.disabled = true;
        try {
          await login(email.value, password.value);
          // Back to an app whose session ended (the gateway sent the browser here), else the start page.
          const pending = location.hash.replace(/^#/, "");
          go(/^\/instances\/[\w-]+\/reopen\?/.test(pending) ? pending : "/allocations");
        } catch (ex) {
          const msg =
            ex instanceof ApiError && ex.status === 401
              ? `Wrong email or password. (${ex.code})`
              : ex instanceof ApiError && ex.status === 423
                ? `This account is locked for a while after too many attempts. (${ex.code})`
                : describe(ex);
          showError(err, msg);
          password.value = "";
          password.focus();
        } finally {
          submit.disabled = false;
        }
      },
    },
    intro ? h("p", null, intro) : null,
    field("Email", email),
    field("Password", password),
    err,
    submit,
  );
  clear(panel, form);
  (presetEmail ? password : email).focus();
}
