// The conversations of the tenant picked, newest first: filters by id prefix, user and last
// activity (kept in the address, so a filtered list can be linked), pages of 50.

import { api } from "./api.js";
import { empty, errorPanel, field, h, number, percent, ratio, replace, table, timeTag } from "./dom.js";
import { go, link } from "./nav.js";

const PAGE = 50;
const HOUR = 3600 * 1000;
// Activity filters: [value, label, active_after offset, active_before offset].
const ACTIVITY = [
  ["", "Any time"],
  ["1h", "Active in the last hour", HOUR],
  ["24h", "Active in the last day", 24 * HOUR],
  ["7d", "Active in the last week", 7 * 24 * HOUR],
  ["30d", "Active in the last 30 days", 30 * 24 * HOUR],
  ["idle30d", "Idle for 30 days or more", null, 30 * 24 * HOUR],
];

export async function showConversations(view, query) {
  const filters = { prefix: query.get("prefix") || "", user: query.get("user") || "", active: query.get("active") || "" };
  const prefix = h("input", { type: "search", name: "prefix", value: filters.prefix, placeholder: "chat-42 or chat-", autocomplete: "off" });
  const user = h("input", { type: "search", name: "user", value: filters.user, placeholder: "OpenAI user", autocomplete: "off" });
  const active = h("select", { name: "active" }, ACTIVITY.map(([value, label]) =>
    h("option", { value, selected: value === filters.active }, label)));
  const form = h(
    "form", { class: "filters", role: "search", "aria-label": "Filter conversations" },
    field("Conversation id or prefix", prefix), field("User", user), field("Activity", active),
    h("button", { type: "submit" }, "Filter"),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    go(link([], { prefix: prefix.value.trim(), user: user.value.trim(), active: active.value }));
  });
  const list = h("div", { class: "list" });
  replace(view, h("h1", {}, "Conversations"), form, list);
  await page(list, filters, null);
}

function params(filters, cursor) {
  const chosen = ACTIVITY.find(([value]) => value === filters.active) || ACTIVITY[0];
  const now = Date.now();
  return {
    limit: PAGE,
    cursor,
    prefix: filters.prefix,
    user: filters.user,
    active_after: chosen[2] ? new Date(now - chosen[2]).toISOString() : null,
    active_before: chosen[3] ? new Date(now - chosen[3]).toISOString() : null,
  };
}

async function page(list, filters, cursor) {
  const status = h("p", { class: "muted loading", role: "status" }, "Loading conversations…");
  list.append(status);
  let found;
  try {
    found = await api("/conversations", { params: params(filters, cursor) });
  } catch (error) {
    status.replaceWith(errorPanel("load the conversations", error));
    return;
  }
  status.remove();
  if (!found.data.length && !cursor) {
    const filtered = filters.prefix || filters.user || filters.active;
    list.append(empty(filtered ? "No conversation matches these filters." : "No conversations yet: send a chat request or import messages."));
    return;
  }
  list.append(rows(found.data));
  if (found.has_more) {
    const more = h("button", { type: "button", class: "more" }, "Load more conversations");
    more.addEventListener("click", () => { more.remove(); page(list, filters, found.next_cursor); });
    list.append(more);
  }
}

// "1 dead, 2 queued", or a dash.
export function pending(jobs) {
  const counts = Object.entries(jobs || {}).filter(([, n]) => n > 0);
  if (!counts.length) return h("span", { class: "muted" }, "none");
  return h("span", { class: counts.some(([status]) => status === "dead") ? "bad" : null },
    counts.map(([status, n]) => `${n} ${status}`).join(", "));
}

function rows(conversations) {
  const columns = [
    ["Conversation", (c) => h("a", { href: link(["c", c.conversation]), class: "conversation-link" }, c.conversation)],
    ["User", (c) => c.user || h("span", { class: "muted" }, "–")],
    ["Messages", (c) => number(c.messages)],
    ["Tokens stored", (c) => number(c.tokens_stored)],
    ["Tokens sent", (c) => number(c.tokens_sent)],
    ["Compression", (c) => (c.tokens_sent ? ratio(c.tokens_full / c.tokens_sent) : "–")],
    ["Cached tokens", (c) => number(c.tokens_cached)],
    ["Memory reuse", (c) => percent(c.memory_reuse)],
    ["Compactions", (c) => number(c.compactions)],
    ["Requests", (c) => number(c.requests)],
    ["Pending jobs", (c) => pending(c.pending_jobs)],
    ["Last activity", (c) => timeTag(c.last_activity)],
  ];
  return table(columns, conversations, { caption: "Conversations, newest first" });
}
