// The summary tree of one conversation, read lazily: the roots first (what no summary covers
// yet, coarsest first), then one node's children when it is opened, a page at a time, down to
// the verbatim messages. Never the whole tree: a 10,000-message conversation costs a page.
// `?node=N` opens the tree down to node N (a search hit) and marks it.

import { api } from "./api.js";
import { empty, errorPanel, h, levelName, number, replace, timeTag, when } from "./dom.js";

const PAGE = 50;
const CONTEXT = 2; // messages shown before a message the tree is opened at
const SHORT_TEXT = 320; // characters of a summary shown before "Read the whole summary"
const FACTS_SHOWN = 8; // key facts of each kind shown before "+N more"

export async function showTree(panel, id, query) {
  const tree = h("ul", { class: "tree", role: "tree", "aria-label": `Memory of ${id}` });
  replace(
    panel,
    h("p", { class: "muted" }, "From the coarsest summaries down to the verbatim messages. Open a node to read what it summarizes."),
    tree,
  );
  const target = Number(query.get("node"));
  if (target > 0) await openAt(tree, id, target);
  else await loadPage(tree, id, null, {});
  if (!tree.querySelector("li")) replace(tree, empty("Nothing stored in this conversation yet."));
}

// The page of `parent`'s children (null: the roots) after or before a message seq.
function fetchPage(id, parent, { after, before }) {
  return api(`/conversations/${encodeURIComponent(id)}/tree`, { params: { parent, after, before, limit: PAGE } });
}

// Draws that page (or the one `fetched` already asked for) into `list`, before `anchor` (null:
// at the end), with buttons for the pages on the sides asked (`earlier`, `later`).
async function loadPage(list, id, parent, range, { anchor = null, earlier = true, later = true, fetched = null } = {}) {
  const status = h("li", { class: "muted loading", role: "none" }, "Loading…");
  list.insertBefore(status, anchor);
  let page;
  try {
    page = await (fetched || fetchPage(id, parent, range));
  } catch (error) {
    status.replaceWith(h("li", { role: "none" }, errorPanel("load this part of the tree", error)));
    return;
  }
  const items = page.nodes.map((node) => item(node, id));
  const pieces = [...items];
  if (items.length && earlier && page.more_before) {
    const before = page.nodes[0].span[0];
    pieces.unshift(pager("Show earlier", () => loadPage(list, id, parent, { before }, { anchor: items[0], later: false })));
  }
  if (items.length && later && page.more_after) {
    const after = page.nodes.at(-1).span[0];
    pieces.push(pager("Show later", () => loadPage(list, id, parent, { after }, { earlier: false })));
  }
  status.replaceWith(...pieces);
}

function pager(label, load) {
  const button = h("button", { type: "button", class: "pager" }, label);
  const row = h("li", { role: "none", class: "pager-row" }, button);
  button.addEventListener("click", () => { row.remove(); load(); });
  return row;
}

function item(node, id) {
  return node.level === 0 ? message(node) : summary(node, id);
}

function summary(node, id) {
  const children = h("ul", { role: "group", class: "children", hidden: true });
  const label = `${levelName(node.level)} ${node.seq}`;
  const toggle = h("button", { type: "button", class: "toggle", "aria-expanded": "false", "aria-label": `Open ${label}` }, "▸");
  const li = h(
    "li", { role: "treeitem", "aria-expanded": "false", class: `node summary level-${Math.min(node.level, 4)}`, dataset: { nodeId: node.id, level: node.level } },
    h("div", { class: "node-row", tabindex: "-1" },
      toggle,
      h("div", { class: "node-head" },
        h("span", { class: "badge" }, label),
        h("span", {}, `messages ${node.span[0]}–${node.span[1]}`),
        h("span", {}, period(node)),
        h("span", {}, node.method ? `${node.method}${node.model ? ` (${node.model})` : ""}` : "method unknown"),
        h("span", {}, `${number(node.children.length)} ${levelName(node.level - 1, node.children.length !== 1)}`),
        h("span", { class: "muted" }, `#${node.id} · ${number(node.token_count)} tokens`))),
    node.text ? clipped(node.text) : h("p", { class: "muted" }, "(no narrative)"),
    facts(node.facts),
    children,
  );
  let loaded = false;
  li.open = async (range = {}, fetched = null) => {
    li.setAttribute("aria-expanded", "true");
    toggle.setAttribute("aria-expanded", "true");
    toggle.setAttribute("aria-label", `Close ${label}`);
    toggle.textContent = "▾";
    children.hidden = false;
    if (!loaded) {
      loaded = true;
      await loadPage(children, id, node.id, range, { fetched });
    }
  };
  const close = () => {
    li.setAttribute("aria-expanded", "false");
    toggle.setAttribute("aria-expanded", "false");
    toggle.setAttribute("aria-label", `Open ${label}`);
    toggle.textContent = "▸";
    children.hidden = true;
  };
  toggle.addEventListener("click", () => (children.hidden ? li.open() : close()));
  return li;
}

function period(node) {
  const start = node.meta?.started_at || node.created_at;
  const end = node.meta?.ended_at || node.created_at;
  const [a, b] = [when(start), when(end)];
  if (a === b) return a;
  return a.slice(0, 10) === b.slice(0, 10) ? `${a} → ${b.slice(11)}` : `${a} → ${b}`;
}

// A summary's narrative, its first lines only until asked for the rest.
function clipped(text) {
  const paragraph = h("p", { class: "summary-text" }, text);
  if (text.length <= SHORT_TEXT) return paragraph;
  paragraph.textContent = `${text.slice(0, SHORT_TEXT)}…`;
  return [paragraph, more("Read the whole summary", () => { paragraph.textContent = text; })];
}

// The key facts by kind, the first few of each until asked for all.
function facts(found) {
  const kinds = Object.entries(found || {}).filter(([, values]) => Array.isArray(values) && values.length);
  if (!kinds.length) return null;
  return h("dl", { class: "facts" }, kinds.map(([kind, values]) => {
    const chips = h("dd", {}, values.slice(0, FACTS_SHOWN).map(chip));
    if (values.length > FACTS_SHOWN) {
      chips.append(more(`+${values.length - FACTS_SHOWN} more`, () => chips.replaceChildren(...values.map(chip))));
    }
    return [h("dt", {}, kind.replaceAll("_", " ")), chips];
  }));
}

const chip = (value) => h("span", { class: "chip" }, value);

function more(label, show) {
  const button = h("button", { type: "button", class: "link" }, label);
  button.addEventListener("click", () => { button.remove(); show(); });
  return button;
}

function message(node) {
  const marks = [];
  if (node.pinned) marks.push(h("span", { class: "mark pinned", title: `importance ${node.importance.toFixed(2)}` }, "pinned"));
  if (node.status && node.status !== "complete") marks.push(h("span", { class: "mark warn" }, node.status));
  if (node.system_prompt) marks.push(h("span", { class: "mark", title: "replaced the conversation's system prompt: never a turn of the history" }, "system prompt"));
  if (node.superseded_at) marks.push(h("span", { class: "mark branch", title: `left the current branch ${when(node.superseded_at)}` }, "superseded"));
  if (node.follows_seq !== undefined && node.follows_seq !== null && node.follows_seq !== node.seq - 1) {
    marks.push(h("span", { class: "mark branch" }, node.follows_seq < 0 ? "branch from the start" : `branch: follows message ${node.follows_seq}`));
  }
  const speaker = node.name ? `${node.role} (${node.name})` : node.role || "?";
  return h(
    "li", { role: "treeitem", class: `node message role-${node.role || "unknown"}`, dataset: { nodeId: node.id, level: 0 } },
    h("div", { class: "node-row", tabindex: "-1" },
      h("div", { class: "node-head" },
        h("span", { class: "badge" }, `message ${node.seq}`),
        h("strong", { class: "speaker" }, speaker),
        timeTag(node.created_at),
        h("span", { class: "muted" }, `#${node.id} · ${number(node.token_count)} tokens`),
        marks)),
    body(node),
  );
}

function body(node) {
  const pieces = [];
  if (node.text) pieces.push(h("div", { class: "verbatim" }, node.text));
  if (Array.isArray(node.content)) {
    const other = node.content.filter((part) => part && part.type && part.type !== "text");
    if (other.length) pieces.push(h("p", { class: "muted" }, other.map((part) => `[${part.type}]`).join(" ")));
  }
  if (node.tool_call_id) pieces.push(h("p", { class: "muted" }, `result of tool call ${node.tool_call_id}`));
  // A reply's other fields (`meta`): what the model refused with, a deprecated `function_call`.
  const meta = node.meta || {};
  if (typeof meta.refusal === "string" && meta.refusal) pieces.push(h("p", { class: "verbatim refusal" }, `refused: ${meta.refusal}`));
  const calls = [...(node.tool_calls || []).map((call) => call.function), meta.function_call];
  for (const fn of calls.filter((one) => one && typeof one === "object")) {
    pieces.push(h("pre", { class: "tool-call" }, `${fn.name || "?"}(${fn.arguments || ""})`));
  }
  return pieces.length ? pieces : h("p", { class: "muted" }, "(no text)");
}

// Opens the tree down to node `target`: its path from the root in one request, then the page
// of each level holding the next one, all asked for at once, drawn top down; marks and focuses it.
async function openAt(tree, id, target) {
  let chain;
  try {
    const found = await api(`/nodes/${target}/path`);
    if (found.conversation !== id) throw new Error(`node ${target} is in conversation ${found.conversation}, not this one`);
    chain = found.path;
  } catch (error) {
    replace(tree, h("li", { role: "none" }, errorPanel(`find node ${target}`, error)));
    return;
  }
  const start = (node) => ({ after: node.level === 0 ? Math.max(-1, node.seq - 1 - CONTEXT) : node.span[0] - 1 });
  const pages = chain.map((node, index) => fetchPage(id, index ? chain[index - 1].id : null, start(node)));
  pages.forEach((page) => page.catch(() => {})); // each is reported where it is drawn
  await loadPage(tree, id, null, start(chain[0]), { fetched: pages[0] });
  for (let index = 1; index < chain.length; index += 1) {
    const li = tree.querySelector(`li[data-node-id="${chain[index - 1].id}"]`);
    if (!li || !li.open) break;
    await li.open(start(chain[index]), pages[index]);
  }
  const found = tree.querySelector(`li[data-node-id="${target}"]`);
  if (!found) return;
  found.classList.add("target");
  const row = found.querySelector(".node-row");
  row.scrollIntoView({ block: "center" });
  row.focus({ preventScroll: true });
}
