"""MoonEP planner, visually: a small local web app (Python standard library only, CPU).

    python apps/web/app.py                 # http://127.0.0.1:8765/
    python apps/web/app.py --port 0        # any free port (printed)

Choose R (EP ranks), E (experts), K (top-k), s (tokens per rank), the router skew (target
maxvio: the hottest expert receives (maxvio+1)x the mean load) and the planner policy
("moonep", "lean" or "cost"; "cost" also takes the cap slack eps and the replica cost in
token copies, defaults 0.05 and 1500: about one replica's link time at s = 1024 on the model
zoo, docs/planner.md).  The page shows the routing histogram (experts coloured by home rank),
the planner's donor -> receiver moves, the redundant experts each rank runs, and the token
copies each rank computes under plain expert parallelism and under MoonEP.  Everything is
computed by ``moonep_ops.plan_all_ranks`` in this process: no ranks, no GPU.

Endpoints: ``/`` (the page), ``/api/plan?R=&E=&K=&s=&skew=&policy=&slack=&replica_cost=&seed=``
(JSON, with the SVG
plots), ``/healthz``.
"""
from __future__ import annotations

import argparse
import html
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import os

import torch

try:
    import moonep_ops
except ImportError:                     # run from a checkout without installing it
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import moonep_ops
from moonep_ops.geometry import MAX_REPLICA_COST, slack_to_ppm
from moonep_ops.planner import POLICIES, replication_cost
from moonep_ops.testing import histogram, maxvio, routing_for_maxvio

# slack, replica_cost: policy "cost"'s inputs (ignored by the other policies)
DEFAULTS = dict(R=8, E=64, K=8, s=1024, skew=10.0, policy="moonep", slack=0.05,
                replica_cost=1500, seed=0)
LIMITS = dict(R=(1, 64), E=(1, 1024), K=(1, 64), s=(1, 8192), seed=(0, 2**31 - 1),
              replica_cost=(0, MAX_REPLICA_COST - 1))
MAX_ENTRIES = 2_000_000          # R*s*K: keeps one request well under a second or two
PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf"]
_LOCK = threading.Lock()         # torch ops are thread-safe, but keep one plan at a time


class BadRequest(ValueError):
    pass


def parse_params(q: dict) -> dict:
    """Query (str -> str) -> validated parameters; raises BadRequest with a one-line message."""
    p = dict(DEFAULTS)
    for k in ("R", "E", "K", "s", "seed", "replica_cost"):
        if k in q and q[k] != "":
            try:
                p[k] = int(q[k])
            except ValueError:
                raise BadRequest(f"{k} must be an integer, got {q[k]!r}")
            lo, hi = LIMITS[k]
            if not lo <= p[k] <= hi:
                raise BadRequest(f"{k} must lie in [{lo}, {hi}], got {p[k]}")
    if "skew" in q and q["skew"] != "":
        try:
            p["skew"] = float(q["skew"])
        except ValueError:
            raise BadRequest(f"skew must be a number, got {q['skew']!r}")
    if "slack" in q and q["slack"] != "":
        try:
            p["slack"] = float(q["slack"])
        except ValueError:
            raise BadRequest(f"slack must be a number, got {q['slack']!r}")
    if not 0.0 <= p["slack"] <= 1.0:
        raise BadRequest(f"slack must lie in [0, 1], got {p['slack']:g}")
    if "policy" in q and q["policy"] != "":
        p["policy"] = q["policy"]
    if p["policy"] not in POLICIES:
        raise BadRequest(f"policy must be one of {', '.join(POLICIES)}")
    R, E, K = p["R"], p["E"], p["K"]
    if E % R:
        raise BadRequest(f"E={E} is not divisible by R={R}")
    if K > E:
        raise BadRequest(f"K={K} > E={E}")
    if not 0 <= p["skew"] <= E - 1:
        raise BadRequest(f"skew (maxvio) must lie in [0, E-1={E - 1}], got {p['skew']:g}")
    if R * p["s"] * K > MAX_ENTRIES:
        raise BadRequest(f"R*s*K = {R * p['s'] * K} token copies is above the demo's limit "
                         f"{MAX_ENTRIES}")
    return p


def compute(p: dict) -> dict:
    """Routing -> plan -> everything the page shows (plain Python numbers)."""
    R, E, K, s = p["R"], p["E"], p["K"], p["s"]
    B = E // R
    tk = routing_for_maxvio(p["skew"], R, E, s, K, seed=p["seed"])
    tpe = histogram(tk, E)
    t0 = time.perf_counter()
    cost = dict(slack_ppm=slack_to_ppm(p["slack"]), replica_cost=p["replica_cost"]) \
        if p["policy"] == "cost" else {}
    res = moonep_ops.plan_all_ranks(tk, E, 1, policy=p["policy"], **cost)
    plan_ms = (time.perf_counter() - t0) * 1e3
    alloc = res.group.alloc_ER.long()
    cnt = tpe.long().sum(0)
    home = torch.arange(E) // B
    plain = cnt.view(R, B).sum(1)
    moon = alloc.sum(0)
    redundant, moved = (int(v) for v in replication_cost(alloc))
    moves = []
    z = res.group.z_RR.long()
    for h in range(R):
        for d in range(R):
            if int(z[h, d]) > 0:
                experts = [(e, int(alloc[e, d])) for e in range(h * B, (h + 1) * B)
                           if int(alloc[e, d]) > 0]
                moves.append(dict(donor=h, receiver=d, tokens=int(z[h, d]), experts=experts))
    etc = res.group.layout.experts_to_copy_RB.long()
    slots = [[int(e) for e in etc[d] if int(e) >= 0] for d in range(R)]
    cap = res.group.caps_R.long() if hasattr(res.group, "caps_R") else moon
    return dict(
        params=p, maxvio=maxvio(tpe), hist=cnt.tolist(), home=home.tolist(),
        plain=plain.tolist(), moonep=moon.tolist(), caps=cap.tolist(),
        plain_ratio=float(plain.max() / plain.float().mean()),
        moonep_ratio=float(moon.max() / moon.float().mean()),
        redundant=redundant, moved=moved, moves=moves, slots=slots, plan_ms=plan_ms,
        lower_bound_moved=int((plain - cap).clamp(min=0).sum()),
    )


# --------------------------------------------------------------------------------------------
# SVG plots (no plotting library: a bar chart is a few rectangles)
# --------------------------------------------------------------------------------------------

def _svg(w, h, body, title, pid):
    return (f'<svg id="{pid}" xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
            f'viewBox="0 0 {w} {h}" role="img" aria-label="{html.escape(title)}">'
            f'<title>{html.escape(title)}</title>'
            f'<rect width="{w}" height="{h}" fill="#fff"/>{body}</svg>')


def svg_histogram(d: dict) -> str:
    hist, home = d["hist"], d["home"]
    E = len(hist)
    W, H, pad = 720, 220, 40
    top = max(hist) or 1
    bw = (W - pad - 10) / E
    mean = sum(hist) / E
    body = []
    for e, (v, r) in enumerate(zip(hist, home)):
        bh = (H - pad - 20) * v / top
        body.append(f'<rect class="bar" data-expert="{e}" data-value="{v}" x="{pad + e * bw:.2f}" '
                    f'y="{H - pad - bh:.2f}" width="{max(bw - 1, 0.5):.2f}" height="{bh:.2f}" '
                    f'fill="{PALETTE[r % len(PALETTE)]}"><title>expert {e} (home rank {r}): '
                    f'{v} copies</title></rect>')
    ym = H - pad - (H - pad - 20) * mean / top
    body.append(f'<line x1="{pad}" x2="{W - 10}" y1="{ym:.2f}" y2="{ym:.2f}" stroke="#000" '
                f'stroke-dasharray="4 3"/><text x="{W - 12}" y="{ym - 4:.2f}" font-size="11" '
                f'text-anchor="end">mean {mean:.0f}</text>')
    body.append(f'<text x="{pad}" y="{H - 12}" font-size="12">experts 0..{E - 1} '
                f'(colour = home rank); max {top} copies</text>')
    return _svg(W, H, "".join(body), "routing histogram", "hist-svg")


def svg_loads(d: dict) -> str:
    plain, moon, caps = d["plain"], d["moonep"], d["caps"]
    R = len(plain)
    W, H, pad = 720, 260, 50
    top = max(max(plain), max(moon), 1)
    gw = (W - pad - 10) / R
    bw = gw * 0.38
    body = []
    for r in range(R):
        for j, (vals, col, name) in enumerate(((plain, "#d62728", "plain EP"),
                                               (moon, "#1f77b4", "MoonEP"))):
            v = vals[r]
            bh = (H - pad - 30) * v / top
            x = pad + r * gw + gw * 0.1 + j * bw
            body.append(f'<rect class="load {name.replace(" ", "-")}" data-rank="{r}" '
                        f'data-value="{v}" x="{x:.2f}" y="{H - pad - bh:.2f}" width="{bw:.2f}" '
                        f'height="{bh:.2f}" fill="{col}"><title>rank {r}, {name}: {v}</title></rect>')
        body.append(f'<text x="{pad + r * gw + gw / 2:.2f}" y="{H - pad + 14}" font-size="11" '
                    f'text-anchor="middle">{r}</text>')
    yc = H - pad - (H - pad - 30) * max(caps) / top
    body.append(f'<line x1="{pad}" x2="{W - 10}" y1="{yc:.2f}" y2="{yc:.2f}" stroke="#000" '
                f'stroke-dasharray="4 3"/>')
    body.append(f'<text x="{pad}" y="{H - 14}" font-size="12">EP rank — '
                f'<tspan fill="#d62728">plain EP</tspan> vs <tspan fill="#1f77b4">MoonEP</tspan>; '
                f'dashed: s·K = {max(caps)}; max {top}</text>')
    return _svg(W, H, "".join(body), "token copies per rank", "loads-svg")


# --------------------------------------------------------------------------------------------
# HTTP
# --------------------------------------------------------------------------------------------

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>MoonEP planner demo</title>
<style>
 body { font-family: system-ui, sans-serif; margin: 1.2em; color: #222; max-width: 980px; }
 fieldset { display: flex; flex-wrap: wrap; gap: 1em; align-items: end; border: 1px solid #ccc; }
 label { display: flex; flex-direction: column; font-size: 0.85em; }
 input[type=number] { width: 6em; }
 #numbers td, #numbers th { padding: 2px 10px; text-align: right; }
 #numbers th { text-align: left; }
 .err { color: #b00; font-weight: bold; }
 table.small { font-size: 0.85em; border-collapse: collapse; }
 table.small td, table.small th { border-bottom: 1px solid #eee; padding: 2px 8px; }
</style></head>
<body>
<h1>MoonEP: perfect load balance for expert parallelism</h1>
<p>Pick a group and a router skew. The planner moves whole chunks of the overloaded ranks'
tokens to underloaded ranks, which run those experts as redundant copies, so every rank computes
exactly s·K token copies (policy cost: at most (1 + slack)·s·K, trading load for fewer
replicas at the given replica cost).</p>
<form id="controls" onsubmit="return false">
<fieldset>
 <label>R (ranks)<input id="R" name="R" type="number" min="1" max="64" value="__R__"></label>
 <label>E (experts)<input id="E" name="E" type="number" min="1" max="1024" value="__E__"></label>
 <label>K (top-k)<input id="K" name="K" type="number" min="1" max="64" value="__K__"></label>
 <label>s (tokens/rank)<input id="s" name="s" type="number" min="1" max="8192" value="__s__"></label>
 <label>skew (maxvio) <span id="skew-out">__skew__</span>
   <input id="skew" name="skew" type="range" min="0" max="40" step="0.5" value="__skew__"></label>
 <label>policy<select id="policy" name="policy">
   <option value="moonep">moonep</option><option value="lean">lean</option>
   <option value="cost">cost</option></select></label>
 <label title="policy cost: a rank may receive up to (1 + slack) x its even share">slack (cost)
   <input id="slack" name="slack" type="number" min="0" max="1" step="0.01" value="__slack__"></label>
 <label title="policy cost: one replica's link time, in token copies of GEMM time">replica cost
   (cost)<input id="replica_cost" name="replica_cost" type="number" min="0" step="100"
   value="__replica_cost__"></label>
 <label>seed<input id="seed" name="seed" type="number" min="0" value="__seed__"></label>
</fieldset></form>
<p id="status">loading…</p>
<table id="numbers">
 <tr><th>measured maxvio</th><td id="n-maxvio"></td></tr>
 <tr><th>plain EP: max / mean load</th><td id="n-plain"></td></tr>
 <tr><th>MoonEP: max / mean load</th><td id="n-moonep"></td></tr>
 <tr><th>redundant experts</th><td id="n-redundant"></td></tr>
 <tr><th>moved token copies (lower bound)</th><td id="n-moved"></td></tr>
 <tr><th>planner time</th><td id="n-ms"></td></tr>
</table>
<h2>Token copies per rank</h2><div id="loads"></div>
<h2>Routing histogram</h2><div id="hist"></div>
<h2>Planner moves (donor → receiver)</h2><div id="moves"></div>
<h2>Redundant experts per rank</h2><div id="slots"></div>
<script>
const ids = ["R", "E", "K", "s", "skew", "policy", "slack", "replica_cost", "seed"];
let seq = 0;
function esc(t) { const d = document.createElement("div"); d.textContent = t; return d.innerHTML; }
async function update() {
  const q = new URLSearchParams();
  for (const k of ids) q.set(k, document.getElementById(k).value);
  document.getElementById("skew-out").textContent = document.getElementById("skew").value;
  const my = ++seq;
  document.getElementById("status").textContent = "planning…";
  const r = await fetch("/api/plan?" + q.toString());
  const d = await r.json();
  if (my !== seq) return;                       // a newer request is on its way
  const st = document.getElementById("status");
  if (d.error) { st.textContent = d.error; st.className = "err"; return; }
  st.className = "";
  const p = d.params;
  st.textContent = `R=${p.R} E=${p.E} K=${p.K} s=${p.s} skew=${p.skew} policy=${p.policy}` +
    (p.policy === "cost" ? ` slack=${p.slack} replica_cost=${p.replica_cost}` : "");
  st.dataset.params = JSON.stringify(p);
  const mean = a => a.reduce((x, y) => x + y, 0) / a.length;
  document.getElementById("n-maxvio").textContent = d.maxvio.toFixed(2);
  document.getElementById("n-plain").textContent =
    `${Math.max(...d.plain)} / ${mean(d.plain).toFixed(0)} (${d.plain_ratio.toFixed(2)}x)`;
  document.getElementById("n-moonep").textContent =
    `${Math.max(...d.moonep)} / ${mean(d.moonep).toFixed(0)} (${d.moonep_ratio.toFixed(2)}x)`;
  document.getElementById("n-redundant").textContent = d.redundant;
  document.getElementById("n-moved").textContent = `${d.moved} (${d.lower_bound_moved})`;
  document.getElementById("n-ms").textContent = d.plan_ms.toFixed(1) + " ms";
  document.getElementById("loads").innerHTML = d.svg_loads;
  document.getElementById("hist").innerHTML = d.svg_hist;
  let mv = '<table class="small" id="moves-table"><tr><th>donor</th><th>receiver</th>' +
           '<th>token copies</th><th>experts (copies)</th></tr>';
  for (const m of d.moves)
    mv += `<tr class="move"><td>${m.donor}</td><td>${m.receiver}</td><td>${m.tokens}</td><td>` +
          esc(m.experts.map(e => `${e[0]} (${e[1]})`).join(", ")) + "</td></tr>";
  if (!d.moves.length) mv += '<tr><td colspan="4">none: every rank is at its cap</td></tr>';
  document.getElementById("moves").innerHTML = mv + "</table>";
  let sl = '<table class="small" id="slots-table"><tr><th>rank</th><th>redundant experts</th></tr>';
  d.slots.forEach((s, r) => { sl += `<tr><td>${r}</td><td>${s.length ? s.join(", ") : "–"}</td></tr>`; });
  document.getElementById("slots").innerHTML = sl + "</table>";
  document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
}
for (const k of ids) {
  const el = document.getElementById(k);
  el.addEventListener("change", update);
  if (k === "skew") el.addEventListener("input", () =>
    { document.getElementById("skew-out").textContent = el.value; });
}
document.getElementById("policy").value = "__policy__";
update();
</script>
</body></html>
"""


def render_page() -> str:
    page = PAGE
    for k, v in DEFAULTS.items():
        page = page.replace(f"__{k}__", str(v))
    return page


def api(query: str) -> tuple[int, dict]:
    q = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    try:
        p = parse_params(q)
        with _LOCK:
            d = compute(p)
    except BadRequest as e:
        return 400, {"error": str(e)}
    d["svg_hist"] = svg_histogram(d)
    d["svg_loads"] = svg_loads(d)
    return 200, d


class Handler(BaseHTTPRequestHandler):
    server_version = "moonep-demo/1"

    def _send(self, code: int, body: bytes, ctype: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):                                   # noqa: N802 (http.server API)
        u = urlparse(self.path)
        if u.path == "/":
            self._send(200, render_page().encode(), "text/html; charset=utf-8")
        elif u.path == "/api/plan":
            code, d = api(u.query)
            self._send(code, json.dumps(d).encode(), "application/json")
        elif u.path == "/healthz":
            self._send(200, b"ok\n", "text/plain")
        else:
            self._send(404, b"not found\n", "text/plain")

    def log_message(self, fmt, *args):                  # quiet unless asked
        if getattr(self.server, "verbose", False):
            super().log_message(fmt, *args)


def make_server(host: str = "127.0.0.1", port: int = 8765, verbose: bool = False):
    srv = ThreadingHTTPServer((host, port), Handler)
    srv.daemon_threads = True
    srv.verbose = verbose
    return srv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="MoonEP planner web demo (local, CPU)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8765, help="0: any free port")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    try:
        srv = make_server(a.host, a.port, a.verbose)
    except OSError as e:
        print(f"error: cannot listen on {a.host}:{a.port}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"MoonEP demo on http://{a.host}:{srv.server_address[1]}/  (Ctrl-C stops it)",
          flush=True)
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        srv.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
