// What the page knows, in one place (window.jetlora, for the browser tests and the curious).
export const state = {
  heartbeats: new Map(), // node -> { hb, seen: Date.now() at arrival }
  nodes: [], // the scheduler's list (NodeInfo): who it counts alive, and nodes silent since before the page opened
  jobs: [], // the scheduler's newest jobs (JobSummary)
  selected: null, follow: null, chart: null, points: [], samples: {}, // the chosen job's view
  groups: [], // co-training groups, as the groups panel shows them
  rl: new Map(), // grpo job -> its latest progress event
  rlChosen: null, rlFollow: null, rlChart: null, rlPoints: [], // the reward curve's job and its points
  tinker: null, // the Tinker panel's data (/tinker.json)
  adapters: [], runs: [], // the registry's adapters and the evals service's runs
  tenants: null, // the scheduler's TenantList: the sharing mode and each tenant's share (tenants panel)
};
window.jetlora = state;
