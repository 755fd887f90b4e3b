// Co-training groups: jobs that train in one process on one device, sharing the base model. The scheduler's jobs
// say which group each trains (or trained) in; the heartbeats say which attempts train in a group now.
import { state } from "./state.js";
import { deviceOf } from "./nodes.js";
import { $, escape, fmt } from "./text.js";

const SHOWN = 20;

export function collectGroups() {
  const groups = new Map();
  const live = new Map(); // job -> group, from the attempts nodes run now
  for (const { hb } of state.heartbeats.values()) for (const a of hb.attempts || []) if (a.group) live.set(a.job, a.group);
  for (const n of state.nodes) for (const a of n.attempts || []) if (a.group) live.set(a.job, a.group);
  for (const j of state.jobs) {
    const id = j.group || live.get(j.id);
    if (!id) continue;
    if (!groups.has(id)) groups.set(id, { id, node: j.node, device: j.device, members: [], created: 0 });
    const g = groups.get(id);
    g.members.push(j);
    g.created = Math.max(g.created, j.created);
    if (live.get(j.id) === id) g.live = true;
  }
  return [...groups.values()].sort((a, b) => (b.live === true) - (a.live === true) || b.created - a.created);
}

export function renderGroups() {
  state.groups = collectGroups();
  const shown = state.groups.slice(0, SHOWN);
  $("groups").innerHTML = shown.map((g) => {
    const training = g.members.filter((j) => ["running", "preparing"].includes(j.state)).length;
    const members = g.members.map((j) => `<div data-member="${escape(j.id)}"><a href="?job=${escape(j.id)}">${escape(j.id)}</a> ` +
      `${escape(j.label)} <span class="state-${escape(j.state)}">${escape(j.state)}</span> ` +
      `step ${j.step}/${j.steps} loss ${fmt(j.loss)}</div>`).join("");
    return `<tr data-group="${escape(g.id)}"><td>${escape(g.id)}</td>` +
      `<td>${escape(g.node ?? "")} ${escape(deviceOf(g.node, g.device))}</td><td>${members}</td>` +
      `<td>${training ? `${training} of ${g.members.length} training` : "ended"}</td></tr>`;
  }).join("") || `<tr><td colspan="4">no co-training groups among the newest jobs</td></tr>`;
}
