// Where the page is: the route in the address's hash (see app.js), and going elsewhere.

export function route() {
  const url = new URL(location.hash.slice(1) || "/", "http://page");
  const parts = url.pathname.split("/").filter(Boolean).map(decodeURIComponent);
  return { parts, query: url.searchParams };
}

// The hash of a route: parts joined, each encoded, and the query's non-empty values.
export function link(parts, query = {}) {
  const path = "#/" + parts.map((part) => encodeURIComponent(String(part))).join("/");
  const search = new URLSearchParams();
  for (const [key, value] of Object.entries(query)) {
    if (value !== null && value !== undefined && value !== "") search.set(key, String(value));
  }
  const rest = search.toString();
  return rest ? `${path}?${rest}` : path;
}

// Go to `hash`, drawing the page again when it is already there.
export function go(hash) {
  if (location.hash === hash) window.dispatchEvent(new HashChangeEvent("hashchange"));
  else location.hash = hash;
}

// A message for the next page drawn (what a view did before leaving, such as a deletion).
let pending = "";
export function flash(text) { pending = text; }
export function takeFlash() {
  const text = pending;
  pending = "";
  return text;
}
