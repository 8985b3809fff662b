// The public API through the gateway (same origin). Problems (RFC 9457) come back as ApiError.
export interface Problem {
  type?: string;
  title?: string;
  status?: number;
  detail?: string;
  code?: string;
  errors?: unknown;
}

export class ApiError extends Error {
  constructor(
    readonly status: number,
    readonly problem: Problem,
  ) {
    super(problem.detail || problem.title || `HTTP ${status}`);
  }
  get code(): string {
    return this.problem.code ?? "unknown";
  }
}

export function describe(err: unknown): string {
  if (err instanceof ApiError) {
    const p = err.problem;
    const detail = p.detail || p.title || `HTTP ${err.status}`;
    return `${detail} (${p.code ?? err.status})`;
  }
  if (err instanceof Error) return err.message;
  return String(err);
}

interface Session {
  access_token: string;
  refresh_token: string | null;
  expires_at: number; // epoch ms
  session_id: string | null;
}

const KEY = "gpuaas.session";
let session: Session | null = load();
let refreshing: Promise<void> | null = null;
const listeners: Array<() => void> = [];

function load(): Session | null {
  try {
    const raw = localStorage.getItem(KEY);
    return raw ? (JSON.parse(raw) as Session) : null;
  } catch {
    return null;
  }
}

function save(s: Session | null): void {
  session = s;
  if (s) localStorage.setItem(KEY, JSON.stringify(s));
  else localStorage.removeItem(KEY);
}

export function onSignedOut(fn: () => void): void {
  listeners.push(fn);
}

export function signedIn(): boolean {
  return session !== null;
}

function adopt(body: Record<string, unknown>): void {
  save({
    access_token: String(body.access_token),
    refresh_token: (body.refresh_token as string | undefined) ?? null,
    expires_at: Date.now() + Number(body.expires_in ?? 300) * 1000,
    session_id: (body.session_id as string | undefined) ?? null,
  });
}

/** One request. A read that fails at the network level (the browser aborts in-flight requests when the
 * machine's network interfaces change, e.g. a VPN or a new bridge) is tried once more; writes never are. */
async function raw(method: string, path: string, init: RequestInit = {}): Promise<Response> {
  const send = () => fetch(path, { method, credentials: "same-origin", ...init });
  if (method !== "GET") return send();
  try {
    return await send();
  } catch {
    await new Promise((r) => setTimeout(r, 300));
    return send();
  }
}

async function parse(resp: Response): Promise<unknown> {
  if (resp.status === 204) return null;
  const text = await resp.text();
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch {
    return { detail: text.slice(0, 300) };
  }
}

export async function login(email: string, password: string): Promise<void> {
  const form = new URLSearchParams({ grant_type: "password", username: email, password });
  const resp = await raw("POST", "/api/identity/auth/token", { body: form });
  const body = (await parse(resp)) as Record<string, unknown>;
  if (!resp.ok) throw new ApiError(resp.status, body as Problem);
  adopt(body);
}

/** Finish an SSO login: exchange the single-use code the identity service handed back for a session,
 * proving with the PKCE verifier that this browser started the login. */
export async function exchangeLoginCode(code: string, codeVerifier: string): Promise<void> {
  const form = new URLSearchParams({ grant_type: "sso_login_code", code, code_verifier: codeVerifier });
  const resp = await raw("POST", "/api/identity/auth/token", { body: form });
  const body = (await parse(resp)) as Record<string, unknown>;
  if (!resp.ok) throw new ApiError(resp.status, body as Problem);
  adopt(body);
}

async function refresh(): Promise<void> {
  if (!session?.refresh_token) throw new ApiError(401, { code: "session_expired", detail: "Your session expired." });
  const form = new URLSearchParams({ grant_type: "refresh_token", refresh_token: session.refresh_token });
  const resp = await raw("POST", "/api/identity/auth/token", { body: form });
  const body = (await parse(resp)) as Record<string, unknown>;
  if (!resp.ok) {
    signOutLocally();
    throw new ApiError(resp.status, body as Problem);
  }
  adopt(body);
}

/** A valid access token (refreshed shortly before it expires), for fetch, SSE and WebSocket. */
export async function token(): Promise<string> {
  if (!session) throw new ApiError(401, { code: "not_signed_in", detail: "Please sign in." });
  if (Date.now() > session.expires_at - 30_000) {
    refreshing ??= refresh().finally(() => (refreshing = null));
    await refreshing;
  }
  return session!.access_token;
}

function signOutLocally(): void {
  save(null);
  for (const fn of listeners) fn();
}

export async function logout(): Promise<void> {
  if (session) {
    try {
      const form = new URLSearchParams();
      if (session.refresh_token) form.set("refresh_token", session.refresh_token);
      await raw("POST", "/api/identity/auth/logout", {
        body: form,
        headers: { Authorization: `Bearer ${await token()}` },
      });
    } catch {
      // the local session goes regardless
    }
  }
  signOutLocally();
}

type Query = Record<string, string | number | boolean | null | undefined>;

export async function api<T = unknown>(
  method: string,
  path: string,
  opts: { json?: unknown; query?: Query; idempotent?: boolean } = {},
): Promise<T> {
  const headers: Record<string, string> = { Authorization: `Bearer ${await token()}`, Accept: "application/json" };
  let body: BodyInit | undefined;
  if (opts.json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(opts.json);
  }
  if (method === "POST" && opts.idempotent !== false) headers["Idempotency-Key"] = crypto.randomUUID();
  let url = path;
  if (opts.query) {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(opts.query)) if (v !== null && v !== undefined && v !== "") q.set(k, String(v));
    const s = q.toString();
    if (s) url += `?${s}`;
  }
  const resp = await raw(method, url, { headers, body });
  const data = await parse(resp);
  if (resp.status === 401) signOutLocally();
  if (!resp.ok) throw new ApiError(resp.status, (data ?? {}) as Problem);
  return data as T;
}

export const get = <T = unknown>(path: string, query?: Query) => api<T>("GET", path, { query });
export const post = <T = unknown>(path: string, json?: unknown) => api<T>("POST", path, { json: json ?? {} });
export const del = <T = unknown>(path: string) => api<T>("DELETE", path);
export const put = <T = unknown>(path: string, json?: unknown) => api<T>("PUT", path, { json: json ?? {} });

/** Anonymous GET (discovery). */
export async function anonymous<T>(path: string, query: Query): Promise<T> {
  const q = new URLSearchParams(Object.entries(query).map(([k, v]) => [k, String(v ?? "")]));
  const resp = await raw("GET", `${path}?${q}`);
  const data = await parse(resp);
  if (!resp.ok) throw new ApiError(resp.status, (data ?? {}) as Problem);
  return data as T;
}

export function wsUrl(path: string): string {
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  return `${proto}//${location.host}${path}`;
}

/** Server-sent events read with fetch (any event name; the token goes in a header). Reconnects after
 * `retryMs` with the last id until `signal` aborts. */
export function streamEvents(
  path: string,
  onEvent: (name: string, data: string, id: string | null) => void,
  signal: AbortSignal,
  retryMs = 2000,
): void {
  let lastId: string | null = null;
  const run = async (): Promise<void> => {
    while (!signal.aborted) {
      try {
        const headers: Record<string, string> = { Authorization: `Bearer ${await token()}`, Accept: "text/event-stream" };
        if (lastId) headers["Last-Event-ID"] = lastId;
        const resp = await fetch(path, { headers, signal });
        if (!resp.ok || !resp.body) throw new Error(`stream answered ${resp.status}`);
        const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
        let buffer = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          buffer += value.replace(/\r\n/g, "\n");
          let cut: number;
          while ((cut = buffer.indexOf("\n\n")) >= 0) {
            const block = buffer.slice(0, cut);
            buffer = buffer.slice(cut + 2);
            let name = "message";
            const data: string[] = [];
            let id: string | null = null;
            for (const line of block.split("\n")) {
              if (line.startsWith(":")) continue;
              const i = line.indexOf(":");
              const key = i < 0 ? line : line.slice(0, i);
              const val = i < 0 ? "" : line.slice(i + 1).replace(/^ /, "");
              if (key === "event") name = val;
              else if (key === "data") data.push(val);
              else if (key === "id") id = val;
            }
            if (id) lastId = id;
            if (data.length) onEvent(name, data.join("\n"), id);
          }
        }
      } catch {
        if (signal.aborted) return;
      }
      await new Promise((r) => setTimeout(r, retryMs));
    }
  };
  void run();
}
