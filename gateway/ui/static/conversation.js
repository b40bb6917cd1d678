// One conversation: its figures, what can be done to it (compact, export, delete), and its
// tabs: the tree, search, the prompt, the graph and its jobs.
//
// The gateway builds no concept graph yet (issue #14 has not landed): the graph tab says so
// and calls nothing.

import { api } from "./api.js";
import { confirmDialog, empty, errorPanel, h, levelName, number, percent, ratio, replace, stat, timeTag } from "./dom.js";
import { pending as pendingJobs } from "./conversations.js";
import { flash, go, link } from "./nav.js";
import { jobsPanel } from "./jobs.js";
import { showPrompt } from "./prompt.js";
import { showSearch } from "./search.js";
import { showTree } from "./tree.js";

const TABS = [
  ["tree", "Tree", showTree],
  ["search", "Search", showSearch],
  ["prompt", "Prompt", showPrompt],
  ["graph", "Graph", showGraph],
  ["jobs", "Jobs", (panel, id) => jobsPanel(panel, { conversation: id })],
];

export async function showConversation(view, id, tab, query) {
  const figures = h("section", { class: "figures", "aria-label": "Figures" });
  const notice = h("div", { role: "status", class: "notice", "aria-live": "polite" });
  const chosen = TABS.find(([key]) => key === tab) || TABS[0];
  const tabs = h("nav", { class: "tabs", "aria-label": "Conversation views" }, TABS.map(([key, label]) =>
    h("a", { href: link(["c", id, key]), "aria-current": key === chosen[0] ? "page" : null, dataset: { tab: key } }, label)));
  const panel = h("section", { class: "tab-panel", "aria-label": chosen[1] });
  replace(
    view,
    h("p", { class: "crumbs" }, h("a", { href: "#/" }, "Conversations"), " / "),
    h("div", { class: "title-row" }, h("h1", { class: "conversation-id" }, id), actions(id, notice)),
    notice, figures, tabs, panel,
  );
  loadFigures(figures, id);
  await chosen[2](panel, id, query);
}

function showGraph(panel) {
  replace(panel, empty("No concept graph: this gateway does not build one. Concepts and their edges will show here once it does."));
}

async function loadFigures(target, id) {
  replace(target, h("p", { class: "muted loading" }, "Loading figures…"));
  try {
    replace(target, figures(await api(`/conversations/${encodeURIComponent(id)}`)));
  } catch (error) {
    replace(target, errorPanel("load this conversation", error));
  }
}

function figures(stats) {
  const levels = Object.entries(stats.levels || {}).sort(([a], [b]) => Number(b) - Number(a));
  const context = stats.working_context;
  return h(
    "dl", { class: "stats" },
    stat("Messages", number(stats.messages)),
    stat("Levels", levels.length
      ? levels.map(([level, count]) => `${number(count)} ${levelName(Number(level), count !== 1)}`).join(" · ")
      : "none yet", null, "wide"),
    stat("Tokens stored", number(stats.tokens_stored), "Tokens of every stored message, verbatim"),
    stat("Tokens sent", number(stats.tokens_sent), "Prompt tokens sent upstream"),
    stat("Compression", ratio(stats.compression_ratio), "Tokens the whole histories would have cost ÷ tokens sent"),
    stat("Cached tokens", number(stats.tokens_cached), "Prompt tokens the upstream reported as cached"),
    stat("Memory reuse", percent(stats.memory_reuse), "Share of the tokens sent that repeated the previous prompt's prefix"),
    stat("Compactions", number(stats.compactions), "Turns whose working context was compacted"),
    stat("Requests", number(stats.requests)),
    context ? stat("Working context", `version ${number(context.version)} · ${number(context.tokens)} tokens · ${number(context.stable_messages)} stable · verbatim from message ${number(context.verbatim_from)}`,
      "The prompt the next turn grows from: stable memory, then the verbatim turns", "wide") : null,
    stat("Pending jobs", pendingJobs(stats.pending_jobs)),
    stat("User", stats.user || "–"),
    stat("Last activity", timeTag(stats.last_activity)),
  );
}

function actions(id, notice) {
  const path = `/conversations/${encodeURIComponent(id)}`;
  const say = (text, kind = "ok") => replace(notice, h("p", { class: kind === "ok" ? "ok" : "error", role: kind === "ok" ? null : "alert" }, text));
  const compact = h("button", { type: "button", class: "quiet" }, "Compact now");
  compact.addEventListener("click", async () => {
    try {
      await api(`${path}/compact`, { method: "POST" });
      say("A compaction is queued: the open segment closes and everything stored gets summarized.");
    } catch (error) {
      replace(notice, errorPanel("queue a compaction", error));
    }
  });
  const exporter = h("button", { type: "button", class: "quiet" }, "Export JSONL");
  exporter.addEventListener("click", async () => {
    try {
      const response = await api(`${path}/export`, { raw: true });
      const url = URL.createObjectURL(await response.blob());
      const anchor = h("a", { href: url, download: `${id}.jsonl` });
      document.body.append(anchor);
      anchor.click();
      anchor.remove();
      setTimeout(() => URL.revokeObjectURL(url), 10_000);
    } catch (error) {
      replace(notice, errorPanel("export this conversation", error));
    }
  });
  const remove = h("button", { type: "button", class: "danger" }, "Delete…");
  remove.addEventListener("click", async () => {
    const sure = await confirmDialog(
      `Delete conversation ${id}?`,
      "Its messages, summaries, embeddings and jobs are deleted for good: nothing can be recovered.",
      "Delete conversation",
    );
    if (!sure) return;
    try {
      const deleted = await api(path, { method: "DELETE" });
      flash(`Deleted conversation ${id}: ${number(deleted.messages)} messages, ${number(deleted.summaries)} summaries and ${number(deleted.jobs)} jobs.`);
      go("#/");
    } catch (error) {
      replace(notice, errorPanel("delete this conversation", error));
    }
  });
  return h("div", { class: "actions" }, compact, exporter, remove);
}
