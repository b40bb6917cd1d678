// The hybrid search box (full text, vectors and passages, fused: `GET /admin/search`) over
// one conversation, or over the tenant's recent conversations; each hit links to its place
// in the tree.

import { api } from "./api.js";
import { empty, errorPanel, field, h, levelName, replace, timeTag } from "./dom.js";
import { link } from "./nav.js";

const LEVELS = [["", "Messages and summaries"], ["0", "Messages only"], ["summaries", "Summaries only"]];

export async function showSearch(panel, id, query) {
  const q = h("input", { type: "search", name: "q", value: query.get("q") || "", required: true, placeholder: "What was decided about the invoice?", autocomplete: "off" });
  const level = h("select", { name: "level" }, LEVELS.map(([value, label]) => h("option", { value }, label)));
  const everywhere = h("input", { type: "checkbox", name: "everywhere" });
  const results = h("div", { class: "results", "aria-live": "polite" });
  const form = h(
    "form", { class: "filters", role: "search", "aria-label": "Search memory" },
    field("Search", q), field("Levels", level),
    h("label", { class: "check" }, everywhere, " All recent conversations of the tenant"),
    h("button", { type: "submit" }, "Search"),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    run(results, id, q.value.trim(), level.value, everywhere.checked);
  });
  replace(panel, form, results);
  if (q.value) await run(results, id, q.value.trim(), "", false);
  else q.focus();
}

async function run(results, id, text, levels, everywhere) {
  if (!text) return;
  replace(results, h("p", { class: "muted loading", role: "status" }, "Searching…"));
  // Eight levels of summaries hold 8^7 segments: deeper trees are not met.
  const level = levels === "summaries" ? [1, 2, 3, 4, 5, 6, 7, 8] : levels === "0" ? [0] : [];
  try {
    const found = await api("/search", {
      params: { q: text, conversation: everywhere ? null : id, level, limit: 25 },
    });
    replace(results, found.data.length ? hits(found.data) : empty(`Nothing found for “${text}”.`));
  } catch (error) {
    replace(results, errorPanel("search", error));
  }
}

function hits(found) {
  return h("ol", { class: "hits" }, found.map((hit) => h(
    "li", { class: "hit", dataset: { nodeId: hit.node_id } },
    h("div", { class: "node-head" },
      h("a", { href: link(["c", hit.conversation, "tree"], { node: hit.node_id }), class: "hit-link" },
        hit.level === 0 ? `message ${hit.seq}` : `${levelName(hit.level)} ${hit.seq}`),
      h("span", {}, hit.level === 0 ? hit.role || "?" : `messages ${hit.span[0]}–${hit.span[1]}`),
      h("span", {}, hit.conversation),
      timeTag(hit.created_at),
      h("span", { class: "muted" }, `#${hit.node_id} · score ${hit.score.toFixed(3)}`)),
    hit.text
      ? h("p", { class: "snippet" }, hit.text.length > 400 ? `${hit.text.slice(0, 400)}…` : hit.text)
      : h("p", { class: "muted" }, "(no text: a tool call; open it in the tree)"),
  )));
}
