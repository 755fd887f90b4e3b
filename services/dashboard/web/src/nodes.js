// The nodes table: each device's free memory from the agents' heartbeats, live; the scheduler's list for nodes
// the page has not heard (silent since before it opened) and for whether a node counts as alive.
import { state } from "./state.js";
import { $, ago, deviceLabel, escape } from "./text.js";

export function onHeartbeat(hb) {
  state.heartbeats.set(hb.node, { hb, seen: Date.now() });
}

export function renderNodes() {
  const names = new Set([...state.nodes.map((n) => n.node), ...state.heartbeats.keys()]);
  const rows = [];
  for (const node of [...names].sort()) {
    const info = state.nodes.find((n) => n.node === node);
    const heard = state.heartbeats.get(node);
    const fresh = heard && Date.now() - heard.seen < 3 * 1000 * (heard.hb.interval_s || 1);
    const alive = fresh || (info && info.alive);
    const source = fresh || !info ? heard.hb : info;
    const since = info && !alive ? ` since ${ago(Date.now() / 1000 - info.last_seen)}` : "";
    const groups = new Map((source.attempts || []).filter((a) => a.group).map((a) => [a.job, a.group]));
    for (const d of source.devices.length ? source.devices : [null]) {
      const shared = d ? [...new Set(d.jobs.filter((j) => groups.has(j)).map((j) => groups.get(j)))] : [];
      const jobs = d ? d.jobs.join(", ") + (shared.length ? ` (co-training group ${shared.join(", ")})` : "") : "";
      rows.push(`<tr class="${alive ? "" : "dead"}" data-node="${escape(node)}"><td>${escape(node)}</td>` +
        `<td>${alive ? "up" : "silent" + since}</td>` +
        (d ? `<td>${escape(deviceLabel(d.index, d.name))}${d.failed ? ` (${escape(d.failed)})` : ""}</td>` +
             `<td>${d.free_mib} / ${d.total_mib} MiB</td><td>${escape(jobs)}</td>`
           : `<td colspan="3">${escape(source.no_gpu_reason)}</td>`) + "</tr>");
    }
  }
  $("nodes").innerHTML = rows.join("") || `<tr><td colspan="5">no agent heartbeats yet</td></tr>`;
}

// a job's device as the nodes name it ("CPU (2 cores)", "GPU 0: …")
export function deviceOf(node, index) {
  if (index === null || index === undefined) return "";
  const heard = state.heartbeats.get(node);
  const info = state.nodes.find((n) => n.node === node);
  const devices = (heard && heard.hb.devices) || (info && info.devices) || [];
  const d = devices.find((x) => x.index === index);
  return deviceLabel(index, d ? d.name : "");
}
