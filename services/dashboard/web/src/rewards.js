// RL rewards: each grpo job's latest figures (the newest progress event of every job, then every new one, keeping
// those that carry rewards), and the reward curve with its pass rate of one of them (the newest, or the one chosen),
// replayed from its first step and followed live.
import { DeliverPolicy } from "@nats-io/jetstream";
import { Chart } from "chart.js";
import { state } from "./state.js";
import { problem } from "./status.js";
import { $, escape, fmt, pct, printable } from "./text.js";

const dec = new TextDecoder();
const SHOWN = 20;
let changed = false;

export async function followRewards(ctx) {
  const { config, js } = ctx;
  renderRewards(ctx);
  setInterval(() => { if (changed) { changed = false; renderRewards(ctx); } }, 1000);
  for (;;) { // one consumer for the page's life; one that breaks is made again, and the status line says so meanwhile
    try {
      const consumer = await js.consumers.get(config.stream, {
        filter_subjects: [config.subjects.all_progress], deliver_policy: DeliverPolicy.LastPerSubject,
      });
      const messages = await consumer.consume();
      problem("rewards", null);
      for await (const m of messages) {
        const ev = JSON.parse(dec.decode(m.data));
        if (!ev.reinforcement) continue;
        const [, , , job, node] = m.subject.split(".");
        const known = state.rl.get(job);
        if (!known || ev.step >= known.step) state.rl.set(job, { ...ev, job, node });
        changed = true;
      }
    } catch (e) {
      problem("rewards", `rewards (the jobs' events): ${e.message}`);
    }
    await new Promise((r) => setTimeout(r, 2000));
  }
}

function newest() {
  let best = null;
  for (const ev of state.rl.values()) if (!best || ev.ts > best.ts) best = ev;
  return best && best.job;
}

export function renderRewards(ctx) {
  const jobs = [...state.rl.values()].sort((a, b) => b.ts - a.ts).slice(0, SHOWN);
  $("rewards").innerHTML = jobs.map((ev) => {
    const r = ev.reinforcement;
    const job = state.jobs.find((j) => j.id === ev.job);
    return `<tr data-rl="${escape(ev.job)}" class="${ev.job === state.rlChosen ? "sel" : ""}"><td>${escape(ev.job)}</td>` +
      `<td>${escape(printable(job ? job.label : ""))}</td><td>${escape(job ? job.state : "")}</td><td>${ev.step}/${ev.steps}</td>` +
      `<td>${fmt(r.reward, 3)} ± ${fmt(r.reward_std, 3)}</td><td>${pct(r.pass_rate)}</td><td>${fmt(ev.eval_reward, 3)}</td>` +
      `<td>${fmt(r.kl, 4)}</td><td>${fmt(r.rollouts_per_s, 1)}</td></tr>`;
  }).join("") || `<tr><td colspan="9">no grpo job has reported rewards</td></tr>`;
  for (const tr of $("rewards").querySelectorAll("tr[data-rl]")) tr.onclick = () => chooseRl(ctx, tr.dataset.rl);
  if (!state.rlChosen && jobs.length) chooseRl(ctx, newest());
}

function newRlChart() {
  if (state.rlChart) state.rlChart.destroy();
  state.rlChart = new Chart($("reward-chart"), {
    type: "line",
    data: { datasets: [
      { label: "reward (mean)", data: [], borderColor: "#2a2", pointRadius: 1, borderWidth: 2, yAxisID: "y" },
      { label: "eval reward", data: [], borderColor: "#a2a", pointRadius: 3, showLine: true, yAxisID: "y" },
      { label: "pass rate", data: [], borderColor: "#e63", pointRadius: 1, borderWidth: 1, yAxisID: "pass" },
    ] },
    options: {
      animation: false, parsing: false,
      plugins: { legend: { labels: { filter: (item, data) => data.datasets[item.datasetIndex].data.length > 0 } } },
      scales: {
        x: { type: "linear", title: { display: true, text: "step" } },
        y: { type: "linear", title: { display: true, text: "reward" } },
        pass: { type: "linear", position: "right", min: 0, max: 1, title: { display: true, text: "pass rate" },
                ticks: { callback: (v) => `${Math.round(v * 100)}%` }, grid: { drawOnChartArea: false } },
      },
    },
  });
}

async function chooseRl(ctx, job) {
  const { config, js } = ctx;
  state.rlChosen = job; // before any await: a render meanwhile does not choose again
  const before = state.rlFollow;
  state.rlFollow = null;
  if (before) await before.close().catch(() => {});
  state.rlPoints = [];
  $("reward-title").textContent = `reward and pass rate of job ${job}`;
  newRlChart();
  for (const tr of $("rewards").querySelectorAll("tr[data-rl]")) tr.className = tr.dataset.rl === job ? "sel" : "";
  const consumer = await js.consumers.get(config.stream, {
    filter_subjects: [config.subjects.job_progress.replace("{job}", job)], deliver_policy: DeliverPolicy.All,
  });
  const messages = await consumer.consume();
  if (state.rlChosen !== job) return messages.close(); // another was chosen meanwhile
  state.rlFollow = messages;
  const [reward, evalReward, pass] = state.rlChart.data.datasets;
  (async () => {
    for await (const m of messages) {
      const ev = JSON.parse(dec.decode(m.data));
      if (!ev.reinforcement) continue;
      state.rlPoints.push({ step: ev.step, reward: ev.reinforcement.reward, pass_rate: ev.reinforcement.pass_rate });
      reward.data.push({ x: ev.step, y: ev.reinforcement.reward });
      pass.data.push({ x: ev.step, y: ev.reinforcement.pass_rate });
      const lastEval = evalReward.data[evalReward.data.length - 1];
      if (ev.eval_reward !== null && ev.eval_reward !== undefined && (!lastEval || lastEval.y !== ev.eval_reward)) {
        evalReward.data.push({ x: ev.step, y: ev.eval_reward }); // each evaluation once (later steps repeat it)
      }
      state.rlChart.update("none");
    }
  })();
}
