// Tenants and fair share (issue 56): how the scheduler shares the fleet now (jetlora.api.tenants, an admin's
// TenantList): each tenant's weight, nominal devices, borrow limit, fair share, devices in use (drawn as a bar
// against its fair share), borrowed and waiting; and the sharing mode above the table.
import { state } from "./state.js";
import { $, escape } from "./text.js";

const PREEMPTED = "preempted: "; // how the scheduler records a pause by preemption (services/scheduler/pausing.py)

function mode(list) {
  const admins = list.admin_class === "above" ? "admins' jobs placed before the tenants'" : "admins' jobs share as one more tenant";
  const devices = `${list.devices} device${list.devices === 1 ? "" : "s"} in the fleet`;
  if (list.sharing === "fifo") return `sharing fifo: priority, then age; a tenant's devices:N caps it · ${devices}`;
  return `sharing fair: weighted max-min, idle devices lent, taken back by checkpoint · ${admins} · ${devices}`;
}

const number = (v) => String(Number(Number(v).toFixed(2)));

// in use against fair share: the bar spans the fleet (or what is held, if more); in use up to the share is blue,
// beyond it amber (devices held over the share: preemptible once a tenant below its share waits); a tick marks the
// share
function bar(t, devices) {
  const scale = Math.max(devices, t.in_use, t.fair_share, 1);
  const within = Math.min(t.in_use, t.fair_share);
  const pct = (n) => `${(100 * n) / scale}%`;
  const over = t.in_use > t.fair_share ? ` (${t.in_use - t.fair_share} over its share)` : "";
  return `<span class="share-bar" title="in use ${t.in_use} of a fair share of ${t.fair_share}${over}">` +
    `<span class="within" style="width:${pct(within)}"></span>` +
    `<span class="over" style="left:${pct(within)};width:${pct(t.in_use - within)}"></span>` +
    `<span class="fair" style="left:${pct(t.fair_share)}"></span></span>`;
}

export function renderTenants() {
  const list = state.tenants;
  if (!list) return;
  $("tenants-mode").textContent = mode(list);
  $("tenants").innerHTML = list.tenants.map((t) => {
    const who = t.tenant === null ? "admins" : t.tenant;
    const waiting = t.queued ? `${t.queued} job${t.queued === 1 ? "" : "s"} (${t.wanted} device${t.wanted === 1 ? "" : "s"})` : "–";
    return `<tr data-tenant="${escape(who)}"><td>${escape(who)}</td><td>${number(t.weight)}</td><td>${t.nominal}</td>` +
      `<td>${t.borrow_limit === null ? "no limit" : t.borrow_limit}</td><td>${t.fair_share}</td>` +
      `<td class="in-use">${bar(t, list.devices)} <span class="use-text">${t.in_use} of ${t.fair_share}</span></td>` +
      `<td>${t.borrowed}</td><td>${waiting}</td></tr>`;
  }).join("") || `<tr><td colspan="8">no tenant holds or waits for a device</td></tr>`;
}

// who preempted a job and why, while it waits to go on from its checkpoint (a Tinker session's stays paused by it)
export function preemptedBy(job) {
  if (job.preempted) return job.preempted;
  return job.state === "paused" && (job.paused_by || "").startsWith(PREEMPTED) ? job.paused_by : "";
}
