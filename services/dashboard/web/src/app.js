// jetlora's dashboard: talks to NATS directly over WebSocket. Subjects come from /config.json,
// which the dashboard server builds from schemas/names.py (the one place subjects are spelt).
import { wsconnect } from "@nats-io/nats-core";
import { jetstream, DeliverPolicy } from "@nats-io/jetstream";
import { Chart, LineController, LineElement, PointElement, LinearScale, Legend, Tooltip } from "chart.js";

Chart.register(LineController, LineElement, PointElement, LinearScale, Legend, Tooltip);

const WINDOW = 20; // moving-average window, as in Unsloth Studio
const enc = new TextEncoder();
const dec = new TextDecoder();
const $ = (id) => document.getElementById(id);
const fmt = (v, d = 4) => (v === null || v === undefined ? "–" : Number(v).toFixed(d));
const sub = (template, values) => template.replace(/\{(\w+)\}/g, (_, k) => values[k]);

const state = { nodes: new Map(), jobs: [], selected: null, follow: null, chart: null, points: [], samples: {} };
window.jetlora = state; // for the browser tests and the curious

async function main() {
  const config = await (await fetch("config.json")).json();
  // replies come under the dashboard user's own inbox prefix, the only one its permissions let it read
  const nc = await wsconnect({ servers: config.ws_url, name: "jetlora-dashboard", inboxPrefix: config.inbox_prefix });
  $("status").textContent = `connected to ${config.ws_url}`;
  const js = jetstream(nc);
  nc.subscribe(config.subjects.heartbeats, {
    callback: (err, msg) => {
      if (err) return;
      const hb = msg.json();
      state.nodes.set(hb.node, { hb, seen: Date.now() });
    },
  });
  setInterval(renderNodes, 1000);
  const refreshJobs = async () => {
    try {
      const reply = await nc.request(config.subjects.list_jobs, enc.encode("{}"), { timeout: 3000 });
      state.jobs = reply.json().jobs || [];
      renderJobs(config, nc, js);
    } catch (e) {
      $("status").textContent = `job list: ${e.message} (is the scheduler running?)`;
    }
  };
  await refreshJobs();
  setInterval(refreshJobs, 2000);
  const refreshAdapters = async () => {
    try {
      const reply = await nc.request(config.subjects.list_adapters, enc.encode("{}"), { timeout: 3000 });
      renderAdapters(reply.json().adapters || []);
    } catch (e) {
      $("adapters").innerHTML = `<tr><td colspan="4">adapter registry: ${escape(e.message)}</td></tr>`;
    }
  };
  await refreshAdapters();
  setInterval(refreshAdapters, 2000);
  const wanted = new URLSearchParams(location.search).get("job");
  if (wanted) select(config, nc, js, wanted);
}

function renderNodes() {
  const rows = [];
  for (const [node, { hb, seen }] of state.nodes) {
    const alive = Date.now() - seen < 3 * 1000 * (hb.interval_s || 1);
    const groups = new Map((hb.attempts || []).filter((a) => a.group).map((a) => [a.job, a.group]));
    for (const d of hb.devices.length ? hb.devices : [null]) {
      const shared = d ? [...new Set(d.jobs.filter((j) => groups.has(j)).map((j) => groups.get(j)))] : [];
      const jobs = d ? d.jobs.join(", ") + (shared.length ? ` (co-training group ${shared.join(", ")})` : "") : "";
      rows.push(`<tr class="${alive ? "" : "dead"}"><td>${node}</td><td>${alive ? "up" : "silent"}</td>` +
        (d ? `<td>${d.index} ${d.name}</td><td>${d.free_mib} / ${d.total_mib} MiB</td><td>${escape(jobs)}</td>`
           : `<td colspan="3">${hb.no_gpu_reason}</td>`) + "</tr>");
    }
  }
  $("nodes").innerHTML = rows.join("") || `<tr><td colspan="5">no agent heartbeats yet</td></tr>`;
}

function renderJobs(config, nc, js) {
  $("jobs").innerHTML = state.jobs.map(  // newest first, as the scheduler lists them
    (j) =>
    `<tr data-job="${j.id}" class="${j.id === state.selected ? "sel" : ""}"><td><a href="?job=${j.id}">${j.id}</a></td>` +
    `<td class="state-${j.state}">${j.state}</td><td>${j.node ?? ""}${j.group ? ` (${escape(j.group)})` : ""}</td><td>${j.step}/${j.steps}</td>` +
    `<td>${fmt(j.loss)}</td><td>${j.label}</td><td>${j.message}</td></tr>`).join("");
  for (const tr of $("jobs").querySelectorAll("tr")) {
    tr.onclick = (ev) => { ev.preventDefault(); select(config, nc, js, tr.dataset.job); };
  }
  const job = state.jobs.find((j) => j.id === state.selected);
  if (job) renderArtifacts(job);
}

function renderAdapters(adapters) {
  $("adapters").innerHTML = adapters.map(({ alias, versions, nodes }) =>
    `<tr><td>${escape(alias.name)}</td><td>${alias.retired ? "retired" : alias.current ? "@" + alias.current : "–"}</td>` +
    `<td>${versions.length}</td><td>${nodes.map((n) => escape(`${n.node}: @${n.version} ${n.state}` +
      (n.smoke ? ` (${Math.round(n.smoke.latency_ms)} ms)` : ""))).join("<br>")}</td></tr>`).join("") ||
    `<tr><td colspan="4">none registered</td></tr>`;
}

function renderArtifacts(job) {
  $("artifacts").innerHTML = job.artifacts.map((a) =>
    `<li><a href="artifacts/${job.id}/${a.kind}" download>${a.kind}</a> ${a.size} bytes, sha256 ${a.sha256.slice(0, 16)}…</li>`)
    .join("") || "<li>none yet</li>";
}

function movingAverage(points) {
  const out = [];
  let sum = 0;
  points.forEach((p, i) => {
    sum += p.y;
    if (i >= WINDOW) sum -= points[i - WINDOW].y;
    out.push({ x: p.x, y: sum / Math.min(i + 1, WINDOW) });
  });
  return out;
}

function newChart() {
  if (state.chart) state.chart.destroy();
  state.chart = new Chart($("loss"), {
    type: "line",
    data: { datasets: [
      { label: "loss", data: [], borderColor: "#9ab", pointRadius: 1, borderWidth: 1 },
      { label: `moving average (${WINDOW})`, data: [], borderColor: "#e63", pointRadius: 0, borderWidth: 2 },
      { label: "eval loss", data: [], borderColor: "#36c", pointRadius: 3, showLine: true },
      // grpo's: the completions' mean reward at each step and the held-out prompts' at each evaluation
      { label: "reward", data: [], borderColor: "#2a2", pointRadius: 1, borderWidth: 2, yAxisID: "reward" },
      { label: "eval reward", data: [], borderColor: "#a2a", pointRadius: 3, showLine: true, yAxisID: "reward" },
    ] },
    options: {
      animation: false, parsing: false,
      plugins: { legend: { labels: { filter: (item, data) => data.datasets[item.datasetIndex].data.length > 0 } } },
      scales: {
        x: { type: "linear", title: { display: true, text: "step" } },
        reward: { type: "linear", position: "right", display: false, title: { display: true, text: "reward" } },
      },
    },
  });
}

function rewardFigures(ev) {
  const r = ev.reinforcement;
  if (!r) return "";
  const kl = r.kl === null || r.kl === undefined ? "" : ` · kl ${fmt(r.kl, 4)}`;
  return ` · reward ${fmt(r.reward, 3)} ± ${fmt(r.reward_std, 3)} · eval reward ${fmt(ev.eval_reward, 3)} · ` +
    `pass ${fmt(100 * r.pass_rate, 0)}%${kl} · ${fmt(r.rollouts_per_s, 1)} rollouts/s` +
    (r.grading_failures ? ` · ${r.grading_failures} grading failures` : "");
}

function escape(text) {
  return text.replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

function showSamples() {
  const { base, adapter } = state.samples;
  const prompts = (adapter || base).samples.map((s) => s.prompt);
  const scored = (x) => (x.score === null || x.score === undefined ? "" : ` (score ${fmt(x.score, 2)})`);
  const answer = (ev, i) => (ev && ev.samples[i] ? escape(ev.samples[i].answer) + scored(ev.samples[i]) : "–");
  $("samples").querySelector("tbody").innerHTML =
    `<tr><th>prompt</th><th>base model</th><th>adapter${adapter ? ` (step ${adapter.step})` : ""}</th></tr>` +
    prompts.map((p, i) => `<tr><td>${escape(p)}</td><td>${answer(base, i)}</td><td>${answer(adapter, i)}</td></tr>`).join("");
}

async function select(config, nc, js, jobId) {
  if (state.follow) await state.follow.close().catch(() => {});
  state.selected = jobId;
  state.points = [];
  state.samples = {};
  $("job-title").textContent = `job ${jobId}`;
  newChart();
  const evals = [], rewards = [], evalRewards = [];
  // replay the job's events from the stream's start, then follow live
  const consumer = await js.consumers.get(config.stream, {
    filter_subjects: [sub(config.subjects.job_events, { job: jobId })], deliver_policy: DeliverPolicy.All,
  });
  const messages = await consumer.consume();
  state.follow = messages;
  (async () => {
    for await (const m of messages) {
      const ev = JSON.parse(dec.decode(m.data));
      if (ev.type === "progress") {
        if (ev.loss !== null) state.points.push({ x: ev.step, y: ev.loss });
        if (ev.eval_loss !== null && !evals.some((e) => e.x === ev.step)) evals.push({ x: ev.step, y: ev.eval_loss });
        if (ev.reinforcement) rewards.push({ x: ev.step, y: ev.reinforcement.reward });
        const evalReward = ev.eval_reward ?? null;
        if (evalReward !== null && !evalRewards.some((e) => e.x === ev.step)) evalRewards.push({ x: ev.step, y: evalReward });
        $("figures").innerHTML = `step ${ev.step}/${ev.steps} · loss ${fmt(ev.loss)} · eval ${fmt(ev.eval_loss)} · ` +
          `lr ${ev.lr === null ? "–" : ev.lr.toExponential(2)} · ${fmt(ev.tokens_per_s, 0)} tok/s · ` +
          `ETA ${fmt(ev.eta_s, 0)} s · peak ${fmt(ev.peak_mib, 0)} MiB` + rewardFigures(ev);
        state.chart.data.datasets[0].data = state.points;
        state.chart.data.datasets[1].data = movingAverage(state.points);
        state.chart.data.datasets[2].data = evals;
        state.chart.data.datasets[3].data = rewards;
        state.chart.data.datasets[4].data = evalRewards;
        state.chart.options.scales.reward.display = rewards.length > 0;
        state.chart.update("none");
      } else if (ev.type === "state") {
        $("job-state").textContent = `${ev.state}: ${ev.message}`;
      } else if (ev.type === "preparing") {
        $("figures").textContent = ev.message;  // tokenizing the data, before the first step
      } else if (ev.type === "samples") {
        state.samples[ev.model] = ev;  // the base model's (once) and the adapter's latest
        showSamples();
      }
    }
  })();
}

main().catch((e) => { $("status").textContent = `cannot connect: ${e.message}`; });
