// The admin API as the page calls it: the admin token and the tenant picked, kept for this
// browser tab (sessionStorage), and every failure turned into an ApiError that says in words
// what went wrong.

const TOKEN = "memstrata.token";
const TENANT = "memstrata.tenant";

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }

  // The error as a sentence for the page.
  describe() {
    if (this.status === 0) return this.message;
    return `${this.message} (HTTP ${this.status}${this.code ? `, ${this.code}` : ""})`;
  }
}

export const session = {
  get token() { return sessionStorage.getItem(TOKEN) || ""; },
  set token(value) {
    if (value) sessionStorage.setItem(TOKEN, value);
    else sessionStorage.removeItem(TOKEN);
  },
  get tenant() { return sessionStorage.getItem(TENANT) || ""; },
  set tenant(value) {
    if (value) sessionStorage.setItem(TENANT, value);
    else sessionStorage.removeItem(TENANT);
  },
};

// Listeners told when the API refuses the token (401), so the page can ask for one.
const refusals = new Set();
export function onRefused(listener) { refusals.add(listener); }

// `path` under /admin; `params` become the query string (null and "" left out; arrays
// repeated); the tenant picked is added unless `tenant: false`.
export async function api(path, { method = "GET", params = {}, body, tenant = true, raw = false } = {}) {
  const url = new URL(`../admin${path}`, document.baseURI);
  const query = { ...params };
  if (tenant && session.tenant) query.tenant = session.tenant;
  for (const [key, value] of Object.entries(query)) {
    for (const one of Array.isArray(value) ? value : [value]) {
      if (one !== null && one !== undefined && one !== "") url.searchParams.append(key, String(one));
    }
  }
  const headers = { Accept: "application/json" };
  if (session.token) headers.Authorization = `Bearer ${session.token}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(url, {
      method, headers, body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "omit", cache: "no-store",
    });
  } catch (error) {
    throw new ApiError(0, `The gateway could not be reached (${error.message}).`);
  }
  if (!response.ok) {
    const error = await failure(response);
    if (response.status === 401) refusals.forEach((listener) => listener(error));
    throw error;
  }
  if (raw) return response;
  const type = response.headers.get("content-type") || "";
  return type.includes("json") ? response.json() : response.text();
}

async function failure(response) {
  let message = response.statusText || "The request failed";
  let code;
  const text = await response.text();
  try {
    const parsed = JSON.parse(text);
    const error = parsed.error || parsed;
    if (typeof error.message === "string") message = error.message;
    else if (Array.isArray(parsed.detail)) message = parsed.detail.map((d) => d.msg).join("; ");
    else if (typeof parsed.detail === "string") message = parsed.detail;
    code = error.code || undefined;
  } catch {
    if (text.trim()) message = text.trim().slice(0, 300);
  }
  return new ApiError(response.status, message, code);
}
