"""GET /pd/dashboard: one self-contained page (no external assets) that polls /pd/workers and
/pd/stats and shows the pool and recent latency percentiles."""

from __future__ import annotations

import time


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def recent_stats(metrics, controller, window: float = 60.0, now: float | None = None) -> dict:
    """Request rate and latency percentiles over the last `window` seconds."""
    now = time.time() if now is None else now
    recent = [r for r in metrics.recent if now - r[0] <= window]
    by_outcome: dict[str, int] = {}
    for r in recent:
        by_outcome[r[1]] = by_outcome.get(r[1], 0) + 1
    done = [r for r in recent if r[1] == "completed"]
    out = {"window_s": window, "requests": len(recent), "by_outcome": by_outcome,
           "rate_per_s": round(len(recent) / window, 3), "in_flight": len(controller.active)}
    for name, idx in (("ttft", 2), ("tpot", 3), ("e2e", 4)):
        vals = [r[idx] for r in done if r[idx] is not None]
        out[name] = {f"p{q}": _percentile(vals, q) for q in (50, 90, 99)}
    return out


DASHBOARD_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pdserve pool</title>
<style>
body{font-family:system-ui,sans-serif;margin:1.5rem;color:#222}
h1{font-size:1.3rem} h2{font-size:1.05rem;margin-top:1.5rem}
table{border-collapse:collapse;min-width:40rem} td,th{border:1px solid #ccc;padding:.25rem .6rem;text-align:right}
th{background:#f3f3f3} td.l,th.l{text-align:left}
.ready{color:#176d2a}.suspect{color:#c2185b}.draining{color:#a86400}.dead{color:#b00020}
.cards span{display:inline-block;margin-right:1.2rem;padding:.4rem .7rem;background:#f3f3f3;border-radius:4px}
.bar{display:inline-block;height:.7rem;background:#4a7bd0;vertical-align:middle}
#err{color:#b00020}
</style></head><body>
<h1>pdserve pool <small id="updated"></small></h1>
<div id="err"></div>
<div class="cards" id="summary"></div>
<h2>Workers</h2>
<table id="workers"><thead><tr><th class="l">id</th><th class="l">role</th><th class="l">state</th>
<th class="l">address</th><th>running</th><th>waiting</th><th>in flight</th><th class="l">KV usage</th>
<th>heartbeat age (s)</th></tr></thead><tbody></tbody></table>
<h2>Requests, last <span id="window"></span> s</h2>
<table id="latency"><thead><tr><th class="l">metric</th><th>p50</th><th>p90</th><th>p99</th></tr></thead>
<tbody></tbody></table>
<p id="rate"></p>
<script>
"use strict";
function fmt(v, unit){ if(v===null||v===undefined) return "-"; return unit==="ms" ? (v*1000).toFixed(1) : v.toFixed(2); }
function cell(row, text, cls){ const td=document.createElement("td"); td.textContent=text; if(cls) td.className=cls; row.appendChild(td); return td; }
async function refresh(){
  try{
    const [workers, stats] = await Promise.all([fetch("/pd/workers").then(r=>r.json()), fetch("/pd/stats").then(r=>r.json())]);
    const tb=document.querySelector("#workers tbody"); tb.textContent="";
    const counts={};
    for(const w of workers){
      const key=w.role+" "+w.state; counts[key]=(counts[key]||0)+1;
      const tr=document.createElement("tr"); tr.dataset.role=w.role; tr.dataset.state=w.state;
      cell(tr,w.id,"l"); cell(tr,w.role,"l"); cell(tr,w.state,"l "+w.state); cell(tr,w.address+":"+w.kv_port,"l");
      cell(tr,w.running); cell(tr,w.waiting); cell(tr,w.inflight);
      const kv=cell(tr,"","l"); const bar=document.createElement("span"); bar.className="bar"; bar.style.width=Math.round(w.kv_usage*100)+"px";
      kv.appendChild(bar); kv.appendChild(document.createTextNode(" "+(w.kv_usage*100).toFixed(1)+"%"));
      cell(tr,w.heartbeat_age_s.toFixed(1)); tb.appendChild(tr);
    }
    const sum=document.getElementById("summary"); sum.textContent="";
    for(const k of Object.keys(counts).sort()){ const s=document.createElement("span"); s.className="count"; s.dataset.key=k; s.textContent=k+": "+counts[k]; sum.appendChild(s); }
    if(!workers.length){ const s=document.createElement("span"); s.textContent="no workers registered"; sum.appendChild(s); }
    const lt=document.querySelector("#latency tbody"); lt.textContent="";
    for(const [name,label] of [["ttft","TTFT (ms)"],["tpot","TPOT (ms)"],["e2e","end to end (s)"]]){
      const tr=document.createElement("tr"); cell(tr,label,"l");
      for(const q of ["p50","p90","p99"]) cell(tr, fmt(stats[name][q], name==="e2e"?"s":"ms"));
      lt.appendChild(tr);
    }
    document.getElementById("window").textContent=stats.window_s;
    document.getElementById("rate").textContent="rate "+stats.rate_per_s.toFixed(2)+" req/s, "+stats.requests+" requests ("+
      Object.entries(stats.by_outcome).map(([k,v])=>k+" "+v).join(", ")+"), "+stats.in_flight+" in flight";
    document.getElementById("updated").textContent="updated "+new Date().toLocaleTimeString();
    document.getElementById("err").textContent="";
  }catch(e){ document.getElementById("err").textContent="cannot reach the controller: "+e; }
}
refresh(); setInterval(refresh, 2000);
</script></body></html>
"""
