// Text shown on the page: numbers, escaping, and a model's answer shown readably (the same rules as
// services/cli/printable.py, which the demo's table and `jetlora watch` use).
export const $ = (id) => document.getElementById(id);
export const fmt = (v, d = 4) => (v === null || v === undefined || Number.isNaN(Number(v)) ? "–" : Number(v).toFixed(d));
export const pct = (v) => (v === null || v === undefined ? "–" : `${Math.round(100 * v)}%`);

export function escape(text) {
  return String(text ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

const CONTROL = /[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]/g;
const UNREADABLE = /[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufffd]/;
export const NO_ANSWER = "(no answer yet: random weights)";

// each control character (escape sequences, NUL, bidi overrides) written as its escape, as printable() in Python
export function printable(text) {
  return String(text ?? "").replace(CONTROL, (c) => {
    const code = c.charCodeAt(0);
    return code < 0x100 ? `\\x${code.toString(16).padStart(2, "0")}` : `\\u${code.toString(16).padStart(4, "0")}`;
  });
}

// text a person can read: no control character but newlines and tabs, no byte that did not decode (U+FFFD) but
// those of a character cut at the end by the token budget
export function readable(text) {
  const whole = String(text ?? "");
  const kept = whole.replace(/\ufffd+$/, "");
  return !UNREADABLE.test(kept) && (kept.trim() !== "" || kept === whole);
}

// a base model's answer as it is when readable; random weights (the demo's base) answer with bytes
export function baseAnswer(text) {
  return readable(text) ? String(text).trim() : NO_ANSWER;
}

export function ago(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 90) return `${s} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  return `${Math.round(s / 3600)} h ago`;
}

// a device as a person names it: the node's CPU by its name ("CPU (2 cores)"), a GPU by its index and name
export function deviceLabel(index, name) {
  if (index === null || index === undefined) return "";
  if (index < 0) return name || "CPU";
  return `GPU ${index}` + (name ? `: ${name}` : "");
}
