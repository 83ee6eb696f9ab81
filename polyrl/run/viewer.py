"""The run viewer (``polyrl view RUN_DIR``): one self-contained HTML page over a run directory.

The page holds the run's data as JSON and draws it with its own inline script and styles (no network, no library):

- curves: one inline SVG line chart per group of known metrics present in ``metrics.jsonl`` (``CHARTS``: loss,
  reward, eval pass@k, accuracy, KL, rollout/trainer mismatch, throughput, ...); each series a
  ``<path data-series=KEY>``, hover shows the values at a step;
- rollouts: the samples saved in ``rollouts.jsonl`` (``polyrl.run.rollout_log``) per step: pick a step, list its
  samples, click one to open its prompt, completion, reward, advantage, finish reason, an episode's messages (tool
  calls, observations) and its tokens coloured by |rollout - trainer| log-prob (when the trainer's were measured) or
  by the rollout's own probability. The URL hash ``#step=S&sample=I`` selects (and opens) a sample on load.

A folder is a run directory when it holds any of ``RUN_FILES`` (``run_config.json`` is written before the first
step). What the page lacks is listed at its top, in the HTML itself: no ``metrics.jsonl`` yet, one without a step,
lines that could not be read (a last line cut by a crash mid-write), an unreadable ``summary.json``.

``render`` returns the page, ``write_page`` writes it, ``serve`` serves it on localhost (re-rendered per request, so
a reload shows a live run's new steps) until Ctrl-C. At most ``max_rollout_steps`` steps of rollouts go into a page
(evenly spaced, first and last kept) so that a long run's page stays loadable.

Not here: writing the files (``MetricsLogger``, ``rollout_log``), the command line (``polyrl.cli.view``).
"""

from __future__ import annotations

import html
import json
import math
import re
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, TextIO

from polyrl.errors import ConfigError
from polyrl.run.config import nearest_existing
from polyrl.run.rollout_log import FILE as ROLLOUTS_FILE
from polyrl.run.rollout_log import read_rows
from polyrl.train.metrics import series_keys

# (title, metric keys): a chart per group with at least one key present; a key with ``*`` is every metric it matches
# (``polyrl.train.metrics.series_keys``: ``eval_pass@*`` -> eval_pass@1, eval_pass@2, ...)
CHARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("loss", "eval_loss", "value_loss")),
    ("reward", ("reward", "eval_reward", "eval_sampled_reward")),
    ("eval pass@k", ("eval_pass@*",)),
    ("accuracy", ("eval_accuracy", "rewards/accuracies", "eval_rewards/accuracies")),
    ("KL", ("kl", "kl_before")),
    ("mismatch |rollout - trainer| log-prob", ("mismatch_mean", "mismatch_max")),
    ("throughput (tokens/s)", ("rollout_tokens_per_s", "tokens_per_s")),
    ("response length (tokens)", ("response_length", "response_length_max", "eval_length")),
    ("entropy", ("entropy",)),
    ("clip fraction", ("clip_fraction",)),
    ("grad norm", ("grad_norm",)),
    ("learning rate", ("lr",)),
    ("time per step (s)", ("time_s", "rollout_s", "reward_s", "reward_wait_s", "logprob_s", "train_s")),
    ("episodes", ("episode/turns", "episode/tool_calls", "episode/tool_call_rate")),
    ("DPO reward margin", ("rewards/margins", "eval_rewards/margins")),
    ("MFU", ("mfu",)),
)
MAX_ROLLOUT_STEPS = 200
METRICS_FILE = "metrics.jsonl"
# any of these makes a folder a run directory: the resolved config is written before the first step, the summary at
# the end (polyrl.run.config.RESOLVED_NAME, polyrl.train.metrics)
RUN_FILES = (METRICS_FILE, ROLLOUTS_FILE, "run_config.json", "summary.json")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """``metrics.jsonl``'s records, the last per step, in step order (torn lines skipped)."""
    return _read_metrics(run_dir)[0]


def _read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """``read_metrics`` and how many non-blank lines were skipped (torn by a crash mid-write, or not a step)."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return [], 0
    by_step: dict[int, dict[str, Any]] = {}
    skipped = 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if isinstance(rec, dict) and _finite(rec.get("step")):
            by_step[int(rec["step"])] = rec
        else:
            skipped += 1
    return [by_step[s] for s in sorted(by_step)], skipped


def _read_summary(run_dir: Path) -> tuple[dict[str, Any], str | None]:
    """``summary.json`` (written when a run ends) and a note when it is there but unreadable."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return {}, None
    try:
        summary = json.loads(path.read_text(errors="replace"))
    except json.JSONDecodeError:
        summary = None
    if not isinstance(summary, dict):
        return {}, "summary.json is not a JSON object (cut short or edited); the run's summary is left out"
    return summary, None


def _notes(run_dir: Path, metrics: list[dict[str, Any]], skipped: int, summary_note: str | None) -> list[str]:
    """What the page lacks and why: no metrics.jsonl (yet), no step in it, lines that could not be read."""
    notes = []
    if not (run_dir / METRICS_FILE).is_file():
        notes.append(f"no {METRICS_FILE} in this run directory yet: curves appear once the run logs its first step")
    elif not metrics:
        notes.append(f"{METRICS_FILE} has no step yet: curves appear once the run logs its first step")
    if skipped:
        notes.append(
            f"{METRICS_FILE}: {skipped} line(s) could not be read and were skipped (a last line cut by a crash "
            "mid-write, or an edited file)"
        )
    if summary_note:
        notes.append(summary_note)
    return notes


def _spaced(steps: list[int], k: int) -> set[int]:
    if len(steps) <= k:
        return set(steps)
    if k <= 1:
        return {steps[-1]}
    return {steps[round(i * (len(steps) - 1) / (k - 1))] for i in range(k)}


def load_run(run_dir: str | Path, max_rollout_steps: int = MAX_ROLLOUT_STEPS) -> dict[str, Any]:
    """The page's data: run name, summary, the chart series present, rollouts (bounded to ``max_rollout_steps``
    steps)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a run directory")
    if not any((run_dir / name).is_file() for name in RUN_FILES):
        raise ConfigError(
            f"{run_dir} is not a run directory: it has none of {', '.join(RUN_FILES)}; give the --out directory of a "
            "polyrl train run"
        )
    metrics, skipped = _read_metrics(run_dir)
    rollouts = read_rows(run_dir / ROLLOUTS_FILE)
    present = list(dict.fromkeys(k for r in metrics for k, v in r.items() if _finite(v)))
    charts = []
    for title, names in CHARTS:
        series = []
        for key in (k for name in names for k in series_keys(name, present)):
            pts = [[r["step"], r[key]] for r in metrics if _finite(r.get(key))]
            if pts:
                series.append({"key": key, "points": pts})
        if series:
            charts.append({"title": title, "series": series})
    steps = sorted({int(r["step"]) for r in rollouts})
    shown = _spaced(steps, max_rollout_steps)
    summary, summary_note = _read_summary(run_dir)
    return {
        "notes": _notes(run_dir, metrics, skipped, summary_note),
        "run": str(run_dir.resolve()),
        "name": run_dir.resolve().name,
        "steps": int(metrics[-1]["step"]) if metrics else (steps[-1] if steps else 0),
        "summary": {k: v for k, v in summary.items() if isinstance(v, (str, int, float)) or v is None},
        "charts": charts,
        "rollout_steps_total": len(steps),
        "rollouts": [r for r in rollouts if int(r["step"]) in shown],
    }


def render(run_dir: str | Path, max_rollout_steps: int = MAX_ROLLOUT_STEPS) -> str:
    """The self-contained HTML page of ``run_dir``."""
    data = load_run(run_dir, max_rollout_steps)
    # "<" escaped inside the JSON strings: nothing in the data can close the script element
    blob = json.dumps(data, default=str, separators=(",", ":")).replace("<", "\\u003c")
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in data["notes"])  # in the HTML itself: no script needed
    parts = {
        "TITLE": html.escape(f"polyrl run {data['name']}"),
        "NOTES": notes,
        "STYLE": _STYLE,
        "DATA": blob,
        "SCRIPT": _SCRIPT,
    }
    return re.sub(r"__(TITLE|NOTES|STYLE|DATA|SCRIPT)__", lambda m: parts[m.group(1)], _PAGE)  # one pass


def write_page(run_dir: str | Path, out: str | Path | None = None, max_rollout_steps: int = MAX_ROLLOUT_STEPS) -> Path:
    """Write the page (default ``RUN_DIR/viewer.html``); its path."""
    out = Path(out) if out is not None else Path(run_dir) / "viewer.html"
    page = render(run_dir, max_rollout_steps)
    existing, blocked = nearest_existing(out.parent.absolute())
    if blocked is not None:
        raise ConfigError(
            f"cannot write the page to {out}: {existing} may not be entered ({blocked.strerror or blocked}); give "
            "--out a file path you can write"
        )
    if not existing.is_dir():
        raise ConfigError(f"cannot write the page to {out}: {existing} is a file, not a folder; give --out a file path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(page, encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"cannot write the page to {out}: {exc.strerror or exc}; give --out a file path you can write"
        ) from None
    return out


def serve(
    run_dir: str | Path,
    port: int = 8765,
    host: str = "127.0.0.1",
    max_rollout_steps: int = MAX_ROLLOUT_STEPS,
    stream: TextIO | None = None,
    ready: Any = None,
) -> None:
    """Serve the page on ``http://host:port/`` (one request at a time; only ``/``) until Ctrl-C. ``ready(server)``
    is called once listening (tests stop it with ``server.shutdown()``)."""
    render(run_dir, max_rollout_steps)  # fail before listening when the directory is not a run

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?", 1)[0] not in ("/", "/index.html"):
                self.send_error(404, "only / is served")
                return
            try:
                body = render(run_dir, max_rollout_steps).encode("utf-8")
            except ConfigError as exc:  # the folder changed under a live page (moved, emptied): say so, no traceback
                self.send_error(500, "polyrl view", str(exc))
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args: Any) -> None:
            pass

    server = HTTPServer((host, port), Handler)
    print(f"serving {run_dir} on http://{host}:{server.server_port}/ (Ctrl-C stops)", file=stream, flush=True)
    if ready is not None:
        ready(server)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=stream, flush=True)
    finally:
        server.server_close()


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>__TITLE__</title>
<style>__STYLE__</style>
</head><body>
<main id="viewer" data-ready="0">
<header><h1 id="title">polyrl run</h1><div id="meta"></div></header>
<ul id="notes">__NOTES__</ul>
<section id="curves"><h2>Curves</h2><div id="charts"></div></section>
<section id="rollouts"><h2>Rollouts</h2>
<div id="step-bar"><button id="prev" type="button">&#9664;</button>
<label>step <select id="step-select"></select></label><button id="next" type="button">&#9654;</button>
<span id="step-note"></span></div>
<div id="browser"><div id="sample-list"></div><div id="sample-view"></div></div>
</section>
</main>
<noscript>This page draws its charts and rollouts with JavaScript.</noscript>
<script type="application/json" id="polyrl-data">__DATA__</script>
<script>__SCRIPT__</script>
</body></html>
"""

_STYLE = """
:root{--fg:#1f2328;--muted:#656d76;--line:#d0d7de;--bg:#fff;--panel:#f6f8fa;--accent:#0969da}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:var(--fg);background:var(--bg)}
main{max-width:1400px;margin:0 auto;padding:14px 20px}
header{display:flex;align-items:baseline;gap:16px;flex-wrap:wrap;border-bottom:1px solid var(--line);padding-bottom:6px}
h1{font-size:20px;margin:0}h2{font-size:16px;margin:14px 0 8px}
#meta{color:var(--muted);font-size:13px}
#notes{color:#9a6700;font-size:13px;margin:6px 0;padding-left:18px}#notes:empty{display:none}
#charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(270px,1fr));gap:10px}
.chart{border:1px solid var(--line);border-radius:6px;padding:6px 8px;background:var(--bg);position:relative}
.chart h3{font-size:13px;margin:0 0 2px;font-weight:600}
.chart svg{width:100%;height:auto;display:block}
.chart .axis{font-size:9px;fill:var(--muted)}
.chart .grid{stroke:#eaeef2;stroke-width:1}
.chart path.line{fill:none;stroke-width:1.6}
.legend{font-size:11px;color:var(--muted);display:flex;gap:10px;flex-wrap:wrap}
.legend i{display:inline-block;width:10px;height:3px;vertical-align:middle;margin-right:3px}
.tip{position:absolute;top:24px;right:10px;background:rgba(255,255,255,.92);border:1px solid var(--line);
 font-size:11px;padding:2px 6px;border-radius:4px;pointer-events:none;display:none;white-space:pre}
#step-bar{display:flex;gap:8px;align-items:center;margin-bottom:8px}
#step-note{color:var(--muted);font-size:12px}
#browser{display:grid;grid-template-columns:minmax(0,440px) minmax(0,1fr);gap:12px;align-items:start}
#sample-list{overflow-x:auto}
#sample-list table{border-collapse:collapse;width:100%;font-size:12px}
#sample-list th,#sample-list td{border-bottom:1px solid var(--line);padding:3px 6px;text-align:left}
#sample-list tr.row{cursor:pointer}#sample-list tr.row:hover{background:var(--panel)}
#sample-list tr.open{background:#ddf4ff}
#sample-list td{white-space:nowrap}
#sample-list td.snippet{max-width:130px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;color:var(--muted)}
#sample-view{border:1px solid var(--line);border-radius:6px;padding:8px 12px;min-height:120px}
#sample-view .facts{display:flex;gap:14px;flex-wrap:wrap;font-size:13px;margin-bottom:6px}
#sample-view .facts b{font-weight:600}
pre{white-space:pre-wrap;word-break:break-word;background:var(--panel);padding:8px;border-radius:4px;margin:4px 0 10px;
 font:12px/1.45 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;max-height:420px;overflow:auto}
.tokens span.t{border-radius:2px}
.tokens span.ctx{color:#8c959f;font-style:italic}
.msg{border-left:3px solid var(--line);padding:2px 8px;margin:6px 0}
.msg .role{font-size:11px;text-transform:uppercase;color:var(--muted);font-weight:600}
.msg.assistant{border-color:var(--accent)}.msg.tool{border-color:#1a7f37}.msg.user{border-color:#bf8700}
.call{font:12px ui-monospace,Menlo,monospace;color:#8250df}
.note{color:var(--muted);font-size:12px}
.empty{color:var(--muted);font-style:italic}
"""

_SCRIPT = r"""
(function () {
  "use strict";
  var D = JSON.parse(document.getElementById("polyrl-data").textContent);
  var COLORS = ["#0969da", "#cf222e", "#1a7f37", "#8250df", "#bf8700", "#57606a"];
  var SVGNS = "http://www.w3.org/2000/svg";

  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function sv(tag, attrs) {
    var e = document.createElementNS(SVGNS, tag);
    for (var k in attrs || {}) e.setAttribute(k, attrs[k]);
    return e;
  }
  function fmt(v) {
    if (v === null || v === undefined) return "-";
    if (typeof v !== "number") return String(v);
    if (v === 0) return "0";
    var a = Math.abs(v);
    if (a >= 1e5 || a < 1e-3) return v.toExponential(2);
    return String(parseFloat(v.toPrecision(4)));
  }
  function niceTicks(lo, hi, n) {
    var span = hi - lo, step = Math.pow(10, Math.floor(Math.log10(span / n)));
    var err = span / n / step;
    if (err >= 7.5) step *= 10; else if (err >= 3.5) step *= 5; else if (err >= 1.5) step *= 2;
    var out = [], dec = Math.max(0, -Math.floor(Math.log10(step) + 1e-9));
    for (var t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(t);
    out.label = function (t) { return dec <= 4 && Math.abs(t) < 1e5 ? t.toFixed(dec) : fmt(t); };
    return out;
  }

  // ---- header ----------------------------------------------------------------------------------
  document.getElementById("title").textContent = "polyrl run " + D.name;
  var meta = [D.run, D.steps + " steps"];
  ["algo", "status", "reward_first", "reward_last", "final_loss", "wall_time_s"].forEach(function (k) {
    if (D.summary[k] !== undefined && D.summary[k] !== null) meta.push(k + " " + fmt(D.summary[k]));
  });
  document.getElementById("meta").textContent = meta.join("  \u00b7  ");

  // ---- curves ----------------------------------------------------------------------------------
  function chart(spec) {
    var W = 360, H = 150, L = 50, R = 8, T = 6, B = 20;
    var box = el("div", {"class": "chart", "data-chart": spec.title});
    box.appendChild(el("h3", {}, spec.title));
    var xs = [], ys = [];
    spec.series.forEach(function (s) { s.points.forEach(function (p) { xs.push(p[0]); ys.push(p[1]); }); });
    var x0 = Math.min.apply(null, xs), x1 = Math.max.apply(null, xs);
    var y0 = Math.min.apply(null, ys), y1 = Math.max.apply(null, ys);
    if (x0 === x1) { x0 -= 1; x1 += 1; }
    if (y0 === y1) { var d = Math.abs(y0) * 0.1 || 1; y0 -= d; y1 += d; }
    var pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
    function X(x) { return L + (x - x0) / (x1 - x0) * (W - L - R); }
    function Y(y) { return T + (1 - (y - y0) / (y1 - y0)) * (H - T - B); }
    var svg = sv("svg", {viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": spec.title});
    var yt = niceTicks(y0, y1, 4);
    yt.forEach(function (t) {
      svg.appendChild(sv("line", {"class": "grid", x1: L, x2: W - R, y1: Y(t), y2: Y(t)}));
      var lab = sv("text", {"class": "axis", x: L - 4, y: Y(t) + 3, "text-anchor": "end"});
      lab.textContent = yt.label(t); svg.appendChild(lab);
    });
    niceTicks(x0, x1, 5).filter(function (t) { return Math.abs(t - Math.round(t)) < 1e-9; }).forEach(function (t) {
      var lab = sv("text", {"class": "axis", x: X(t), y: H - 6, "text-anchor": "middle"});
      lab.textContent = fmt(t); svg.appendChild(lab);
    });
    svg.appendChild(sv("line", {"class": "grid", x1: L, x2: L, y1: T, y2: H - B, stroke: "#afb8c1"}));
    var legend = el("div", {"class": "legend"});
    spec.series.forEach(function (s, i) {
      var c = COLORS[i % COLORS.length];
      var d = s.points.map(function (p, j) { return (j ? "L" : "M") + X(p[0]).toFixed(1) + " " + Y(p[1]).toFixed(1); });
      svg.appendChild(sv("path", {"class": "line", d: d.join(""), stroke: c, "data-series": s.key,
                                  "data-points": s.points.length}));
      if (s.points.length <= 40) s.points.forEach(function (p) {
        svg.appendChild(sv("circle", {cx: X(p[0]), cy: Y(p[1]), r: 2, fill: c}));
      });
      var item = el("span", {}); var sw = el("i", {}); sw.style.background = c;
      item.appendChild(sw); item.appendChild(document.createTextNode(s.key)); legend.appendChild(item);
    });
    var cursor = sv("line", {x1: 0, x2: 0, y1: T, y2: H - B, stroke: "#8c959f", "stroke-dasharray": "3 3",
                             visibility: "hidden"});
    svg.appendChild(cursor);
    var tip = el("div", {"class": "tip"});
    var hit = sv("rect", {x: L, y: T, width: W - L - R, height: H - T - B, fill: "transparent"});
    hit.addEventListener("mousemove", function (ev) {
      var r = svg.getBoundingClientRect();
      var x = x0 + ((ev.clientX - r.left) / r.width * W - L) / (W - L - R) * (x1 - x0);
      var best = null;
      xs.forEach(function (v) { if (best === null || Math.abs(v - x) < Math.abs(best - x)) best = v; });
      cursor.setAttribute("x1", X(best)); cursor.setAttribute("x2", X(best));
      cursor.setAttribute("visibility", "visible");
      var lines = ["step " + best];
      spec.series.forEach(function (s) {
        s.points.forEach(function (p) { if (p[0] === best) lines.push(s.key + " " + fmt(p[1])); });
      });
      tip.textContent = lines.join("\n"); tip.style.display = "block";
    });
    hit.addEventListener("mouseleave", function () {
      cursor.setAttribute("visibility", "hidden"); tip.style.display = "none";
    });
    svg.appendChild(hit);
    box.appendChild(svg); box.appendChild(legend); box.appendChild(tip);
    return box;
  }
  var charts = document.getElementById("charts");
  if (!D.charts.length) charts.appendChild(el("p", {"class": "empty"}, "metrics.jsonl holds no known curve yet."));
  D.charts.forEach(function (c) { charts.appendChild(chart(c)); });

  // ---- rollouts --------------------------------------------------------------------------------
  var byStep = {};
  D.rollouts.forEach(function (r) { (byStep[r.step] = byStep[r.step] || []).push(r); });
  var steps = Object.keys(byStep).map(Number).sort(function (a, b) { return a - b; });
  var select = document.getElementById("step-select");
  var list = document.getElementById("sample-list"), view = document.getElementById("sample-view");
  steps.forEach(function (s) { select.appendChild(el("option", {value: s}, s)); });
  var note = document.getElementById("step-note");
  if (!steps.length) {
    note.textContent = "no rollouts.jsonl rows in this run (offline runs save none; online runs save " +
      "rollouts_to_save per step, 0 = none)";
  } else if (D.rollout_steps_total > steps.length) {
    note.textContent = "showing " + steps.length + " of " + D.rollout_steps_total + " steps (evenly spaced)";
  }

  function meanAbsDiff(r) {
    if (!r.trainer_logprobs || !r.logprobs) return null;
    var s = 0, n = 0;
    for (var i = 0; i < r.logprobs.length; i++) {
      var a = r.logprobs[i], b = r.trainer_logprobs[i];
      if (a !== null && b !== null && b !== undefined) { s += Math.abs(a - b); n++; }
    }
    return n ? s / n : null;
  }
  function snippet(t) {
    t = (t || "").replace(/\s+/g, " ").trim();
    return t.length > 60 ? t.slice(0, 60) + "\u2026" : t;
  }

  function showStep(step, sample) {
    step = Number(step);
    if (!byStep[step]) return;
    select.value = String(step);
    list.textContent = "";
    var table = el("table", {"data-step": step});
    var head = el("tr", {});
    ["#", "group", "reward", "adv", "finish", "tokens", "|\u0394lp|", "completion"].forEach(function (h) {
      head.appendChild(el("th", {}, h));
    });
    table.appendChild(head);
    byStep[step].forEach(function (r) {
      var tr = el("tr", {"class": "row", "data-sample": r.sample});
      [r.sample, r.group, fmt(r.reward), fmt(r.advantage), r.finish_reason, (r.tokens || []).length,
       fmt(meanAbsDiff(r))].forEach(function (v) { tr.appendChild(el("td", {}, v)); });
      tr.appendChild(el("td", {"class": "snippet"}, snippet(r.completion)));
      tr.addEventListener("click", function () { openSample(step, r.sample, true); });
      table.appendChild(tr);
    });
    list.appendChild(table);
    if (sample === undefined || sample === null) {
      view.textContent = "";
      view.appendChild(el("p", {"class": "empty"}, "click a sample to open it"));
      view.removeAttribute("data-sample");
    } else {
      openSample(step, sample, false);
    }
  }

  function tokenView(r) {
    var box = el("pre", {"class": "tokens", id: "tokens"});
    var tl = r.trainer_logprobs, lp = r.logprobs || [], byMismatch = !!tl;
    (r.tokens || []).forEach(function (tok, i) {
      var span = el("span", {}, tok);
      var a = lp[i], b = tl ? tl[i] : null;
      if (a === null || a === undefined) { span.className = "ctx"; box.appendChild(span); return; }
      span.className = "t";
      var tip = "log-prob " + fmt(a), alpha;
      if (byMismatch && b !== null && b !== undefined) {
        var d = Math.abs(a - b);
        tip += "  trainer " + fmt(b) + "  |diff| " + fmt(d);
        alpha = Math.min(d / 0.5, 1);
        span.style.background = "rgba(207,34,46," + (0.08 + 0.72 * alpha).toFixed(3) + ")";
        span.setAttribute("data-diff", d.toFixed(4));
      } else {
        alpha = 1 - Math.exp(a);
        span.style.background = "rgba(191,135,0," + (0.05 + 0.6 * alpha).toFixed(3) + ")";
      }
      span.title = tip;
      box.appendChild(span);
    });
    return box;
  }

  function messageView(m) {
    var role = m.role || "?";
    var box = el("div", {"class": "msg " + role});
    var label = role + (m.name ? " (" + m.name + ")" : "") + (m.tool_call_id ? " \u2190 " + m.tool_call_id : "");
    box.appendChild(el("div", {"class": "role"}, label));
    var content = m.content;
    if (Array.isArray(content)) {
      content = content.map(function (p) { return p && p.text !== undefined ? p.text : JSON.stringify(p); }).join("");
    }
    if (content) box.appendChild(el("pre", {}, content));
    (m.tool_calls || []).forEach(function (c) {
      var f = c["function"] || c;
      box.appendChild(el("div", {"class": "call"}, "\u2192 " + (f.name || "?") + "(" + (f.arguments || "") + ")" +
                                                   (c.id ? "  [" + c.id + "]" : "")));
    });
    (m.invalid_tool_calls || []).forEach(function (c) {
      box.appendChild(el("div", {"class": "call"}, "invalid tool call: " + JSON.stringify(c)));
    });
    return box;
  }

  function openSample(step, sample, push) {
    sample = Number(sample);
    var r = (byStep[step] || []).filter(function (x) { return x.sample === sample; })[0];
    if (!r) return;
    Array.prototype.forEach.call(list.querySelectorAll("tr.row"), function (tr) {
      tr.classList.toggle("open", Number(tr.getAttribute("data-sample")) === sample);
    });
    view.textContent = "";
    view.setAttribute("data-step", step); view.setAttribute("data-sample", sample);
    view.appendChild(el("h3", {}, "step " + step + ", sample " + sample + (r.kind === "episode" ? " (episode)" : "")));
    var facts = el("div", {"class": "facts"});
    [["reward", fmt(r.reward)], ["advantage", fmt(r.advantage)], ["finish", r.finish_reason], ["group", r.group],
     ["tokens", (r.tokens || []).length], ["mean |rollout - trainer| log-prob", fmt(meanAbsDiff(r))]]
      .forEach(function (kv) {
        var s = el("span", {});
        s.appendChild(el("b", {}, kv[0] + " ")); s.appendChild(document.createTextNode(kv[1]));
        facts.appendChild(s);
      });
    view.appendChild(facts);
    if (r.error) view.appendChild(el("p", {"class": "note"}, "error: " + r.error));
    view.appendChild(el("h4", {}, "prompt"));
    view.appendChild(el("pre", {id: "prompt"}, r.prompt));
    if (r.messages && r.messages.length) {
      view.appendChild(el("h4", {}, "messages"));
      var ms = el("div", {id: "messages"});
      r.messages.forEach(function (m) { ms.appendChild(messageView(m)); });
      view.appendChild(ms);
    }
    view.appendChild(el("h4", {}, r.kind === "episode" ? "transcript after the prompt" : "completion"));
    view.appendChild(el("pre", {id: "completion"}, r.completion));
    view.appendChild(el("h4", {}, "tokens"));
    view.appendChild(el("p", {"class": "note"}, r.trainer_logprobs
      ? "red: |rollout - trainer| log-prob per token (full at 0.5); hover a token for its numbers"
      : "amber: 1 - rollout probability per token (the trainer's log-probs were not measured for this sample: " +
        "single-pass runs measure mismatch inside the training forward, and samples left out of the update are " +
        "not measured)" + (r.mask ? "; grey: observations and template, not sampled" : "")));
    view.appendChild(tokenView(r));
    if (push) history.replaceState(null, "", "#step=" + step + "&sample=" + sample);
  }

  function fromHash() {
    var q = {};
    location.hash.replace(/^#/, "").split("&").forEach(function (kv) {
      var p = kv.split("="); if (p[0]) q[p[0]] = decodeURIComponent(p[1] || "");
    });
    var step = q.step !== undefined && byStep[Number(q.step)] ? Number(q.step) : steps[steps.length - 1];
    if (step !== undefined) showStep(step, q.sample !== undefined ? Number(q.sample) : null);
  }
  select.addEventListener("change", function () {
    showStep(select.value, null); history.replaceState(null, "", "#step=" + select.value);
  });
  function move(d) {
    var i = steps.indexOf(Number(select.value)) + d;
    if (i >= 0 && i < steps.length) { showStep(steps[i], null); history.replaceState(null, "", "#step=" + steps[i]); }
  }
  document.getElementById("prev").addEventListener("click", function () { move(-1); });
  document.getElementById("next").addEventListener("click", function () { move(1); });
  window.addEventListener("hashchange", fromHash);
  fromHash();
  document.getElementById("viewer").setAttribute("data-ready", "1");
})();
"""

__all__ = ["CHARTS", "MAX_ROLLOUT_STEPS", "RUN_FILES", "load_run", "read_metrics", "render", "serve", "write_page"]
