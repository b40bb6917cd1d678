// The background job queue of the tenant picked (or of one conversation): how many jobs are
// in each status, the newest jobs of a status, dead letters with their last error, and a
// button that queues a dead or backing-off job to run now.

import { api } from "./api.js";
import { empty, errorPanel, h, number, replace, stat, table, timeTag } from "./dom.js";
import { link } from "./nav.js";

const STATUSES = [["", "All"], ["queued", "Queued"], ["running", "Running"], ["dead", "Dead letters"], ["done", "Done"]];

export async function showJobs(view, { status }) {
  const panel = h("div");
  replace(view, h("h1", {}, "Jobs"), panel);
  await jobsPanel(panel, { status });
}

// `conversation`: only its jobs (the depth stays the tenant's).
export async function jobsPanel(panel, { status = "", conversation = null }) {
  const depth = h("div", { class: "depth" });
  const notice = h("div", { role: "status", "aria-live": "polite" });
  const list = h("div");
  let shown = status;
  const filter = h("div", { class: "segmented", role: "group", "aria-label": "Job status" }, STATUSES.map(([value, label]) => {
    const button = h("button", { type: "button", "aria-pressed": String(value === shown), dataset: { status: value } }, label);
    button.addEventListener("click", () => {
      shown = value;
      for (const other of filter.querySelectorAll("button")) other.setAttribute("aria-pressed", String(other === button));
      load();
    });
    return button;
  }));
  const load = async () => {
    replace(list, h("p", { class: "muted loading", role: "status" }, "Loading jobs…"));
    try {
      const found = await api("/jobs", { params: { status: shown, conversation, limit: 100 } });
      replace(depth, depthView(found.depth, conversation));
      replace(list, found.jobs.length ? jobsTable(found.jobs, retry) : empty(shown ? `No ${shown} jobs.` : "No jobs."));
    } catch (error) {
      replace(list, errorPanel("load the jobs", error));
    }
  };
  const retry = async (job) => {
    try {
      const answer = await api(`/jobs/${job.id}/retry`, { method: "POST" });
      replace(notice, h("p", { class: answer.queued ? "ok" : "muted" }, answer.queued
        ? `Job ${job.id} is queued to run now, its attempts reset.`
        : `Job ${job.id} was not queued: it is running or done, or the same work is already queued.`));
    } catch (error) {
      replace(notice, errorPanel(`retry job ${job.id}`, error));
    }
    await load();
  };
  replace(panel, depth, filter, notice, list);
  await load();
}

function depthView(depth, conversation) {
  return h(
    "dl", { class: "stats", "aria-label": conversation ? "The tenant's queue" : "Queue depth" },
    ["queued", "running", "dead", "done", "failures"].map((key) => stat(
      key === "failures" ? "Failing" : key[0].toUpperCase() + key.slice(1), number(depth[key] ?? 0),
      key === "failures" ? "Failed at least once and not done" : null)),
  );
}

function jobsTable(jobs, retry) {
  const columns = [
    ["Job", (job) => `#${job.id}`],
    ["Kind", (job) => job.kind],
    ["Conversation", (job) => job.conversation ? h("a", { href: link(["c", job.conversation]) }, job.conversation) : "–"],
    ["Status", (job) => h("span", { class: `status status-${job.status}` }, job.status)],
    ["Attempts", (job) => `${job.attempts} / ${job.max_attempts}`],
    ["Last error", (job) => job.last_error ? h("code", { class: "last-error" }, job.last_error) : "–"],
    ["Updated", (job) => timeTag(job.updated_at)],
    ["", (job) => job.status === "dead" || (job.status === "queued" && job.attempts > 0)
      ? h("button", { type: "button", class: "retry", onclick: () => retry(job), "aria-label": `Retry job ${job.id}` }, "Retry")
      : null],
  ];
  return table(columns, jobs, { caption: "Jobs, newest first", rowAttrs: (job) => ({ class: `job job-${job.status}`, dataset: { jobId: job.id } }) });
}
