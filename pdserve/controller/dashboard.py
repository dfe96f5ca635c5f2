"""GET /pd/dashboard: one self-contained page (no external assets, charts drawn as inline SVG)
that polls /pd/workers, /pd/stats and /pd/history and shows the pool, recent latency
percentiles, and over a selectable window (5 min, 1 h; `?window=` seconds in the address) time
series of the controller's figures with the pool's membership changes marked on the time axis,
the route mix (local prefill or KV handoff) and the recent failures."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.controller.client import PDController
    from pdserve.controller.metrics import Metrics


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


def recent_stats(metrics: Metrics, controller: PDController, window: float = 60.0,
                 now: float | None = None) -> dict[str, Any]:
    """Request rate and latency percentiles over the last `window` seconds."""
    now = time.time() if now is None else now
    recent = [r for r in metrics.recent if now - r[0] <= window]
    by_outcome: dict[str, int] = {}
    for r in recent:
        by_outcome[r[1]] = by_outcome.get(r[1], 0) + 1
    done = [r for r in recent if r[1] == "completed"]
    out: dict[str, Any] = {
        "window_s": window, "requests": len(recent), "by_outcome": by_outcome,
        "rate_per_s": round(len(recent) / window, 3), "in_flight": len(controller.active)}
    columns: dict[str, list[float | None]] = {
        "ttft": [r[2] for r in done], "tpot": [r[3] for r in done], "e2e": [r[4] for r in done]}
    for name, column in columns.items():
        vals = [v for v in column if v is not None]
        out[name] = {f"p{q}": _percentile(vals, q) for q in (50, 90, 99)}
    return out


DASHBOARD_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>pdserve pool</title>
<style>
body{font-family:system-ui,sans-serif;margin:1.5rem;color:#222}
h1{font-size:1.3rem} h2{font-size:1.05rem;margin-top:1.5rem}
table{border-collapse:collapse;min-width:40rem} td,th{border:1px solid #ccc;padding:.25rem .6rem;text-align:right}
th{background:#f3f3f3} td.l,th.l{text-align:left}
.ready{color:#176d2a}.suspect{color:#c2185b}.stalled{color:#8e24aa}.draining{color:#a86400}.dead{color:#b00020}
.cards span{display:inline-block;margin-right:1.2rem;padding:.4rem .7rem;background:#f3f3f3;border-radius:4px}
.bar{display:inline-block;height:.7rem;background:#4a7bd0;vertical-align:middle}
#err{color:#b00020}
#spans button{font:inherit;padding:.2rem .7rem;border:1px solid #999;background:#fff;border-radius:3px;cursor:pointer}
#spans button.on{background:#4a7bd0;border-color:#4a7bd0;color:#fff}
.mix{display:inline-flex;width:16rem;height:.8rem;vertical-align:middle;background:#eee;border-radius:2px;overflow:hidden}
.mix i{display:block;height:100%}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(580px,1fr));gap:1rem 1.5rem}
figure{margin:0} figcaption{font-weight:600;font-size:.9rem;margin-bottom:.2rem}
svg text{font-size:10px;fill:#555} svg .grid{stroke:#e4e4e4} svg .axis{stroke:#999}
svg path.line{fill:none;stroke-width:1.6;stroke-linecap:round;stroke-linejoin:round}
svg line.mark{stroke-width:1.2;stroke-dasharray:3 2}
.legend{font-size:.8rem;margin-top:.1rem} .legend span{margin-right:.9rem;white-space:nowrap}
.legend i,.key i{display:inline-block;width:.8rem;height:.25rem;margin-right:.3rem;vertical-align:middle}
.key{font-size:.8rem;margin:.4rem 0} .key span{margin-right:.9rem}
td.reason{text-align:left;max-width:48rem;font-size:.85rem}
</style></head><body>
<h1>pdserve pool <small id="updated"></small></h1>
<div id="err"></div>
<div class="cards" id="summary"></div>
<h2>Workers</h2>
<table id="workers"><thead><tr><th class="l">id</th><th class="l">role</th><th class="l">state</th>
<th class="l">address</th><th>running</th><th>waiting</th><th>in flight</th><th class="l">KV usage</th>
<th>heartbeat age (s)</th><th class="l">cost model</th></tr></thead><tbody></tbody></table>
<h2>Requests, last <span id="window"></span> s</h2>
<table id="latency"><thead><tr><th class="l">metric</th><th>p50</th><th>p90</th><th>p99</th></tr></thead>
<tbody></tbody></table>
<p id="rate"></p>
<h2>Over time <span id="spans"><button data-window="300">5 min</button> <button data-window="3600">1 h</button></span>
<small id="step"></small></h2>
<div class="cards" id="routes"></div>
<div class="key" id="key"></div>
<div class="charts" id="charts"></div>
<h2>Recent failures</h2>
<table id="failures"><thead><tr><th class="l">time</th><th class="l">what</th><th class="l">worker</th>
<th class="l">reason</th></tr></thead><tbody></tbody></table>
<h2>Pool changes</h2>
<table id="events"><thead><tr><th class="l">time</th><th class="l">worker</th><th class="l">role</th>
<th class="l">change</th></tr></thead><tbody></tbody></table>
<script>
"use strict";
const SVG="http://www.w3.org/2000/svg";
const MARKS={joined:"#2e7d32",draining:"#ef6c00",suspect:"#c2185b",stalled:"#8e24aa",cleared:"#00897b",dead:"#b00020",left:"#757575"};
const PALETTE=["#4a7bd0","#d0743c","#2e9d5b","#a04ac0","#c9a227","#3bb0c9","#d04a7b","#6b6b6b","#7b4a2e","#8fbf3a"];
const FAILS={prefill_retry:"prefill retried",migration:"migrated",failed:"request failed"};
let span=Number(new URLSearchParams(location.search).get("window"))||300;
function fmt(v, unit){ if(v===null||v===undefined) return "-"; return unit==="ms" ? (v*1000).toFixed(1) : v.toFixed(2); }
function cell(row, text, cls){ const td=document.createElement("td"); td.textContent=text; if(cls) td.className=cls; row.appendChild(td); return td; }
function node(tag, attrs, parent, text){
  const e=document.createElementNS(SVG, tag);
  for(const [k,v] of Object.entries(attrs)) e.setAttribute(k, v);
  if(text!==undefined) e.textContent=text;
  parent.appendChild(e); return e;
}
function clock(t){ return new Date(t*1000).toLocaleTimeString([], {hour12:false}); }
function niceMax(v){
  if(!(v>0)) return 1;
  const p=Math.pow(10, Math.floor(Math.log10(v)));
  for(const m of [1,2,2.5,5,10]) if(v<=m*p*1.0000001) return m*p;
  return 10*p;
}
function short(v){ return Math.abs(v)>=100 ? v.toFixed(0) : Math.abs(v)>=10 ? v.toFixed(1) : Number(v.toPrecision(2)).toString(); }

// One chart: lines over the window [now - window, now], membership changes as dashed marks.
function chart(h, spec){
  const fig=document.createElement("figure"); fig.className="chart"; fig.dataset.chart=spec.key;
  const cap=document.createElement("figcaption"); cap.textContent=spec.title; fig.appendChild(cap);
  const W=580, H=170, L=44, R=8, T=8, B=20, pw=W-L-R, ph=H-T-B;
  const t1=h.now, t0=h.since;
  let top=spec.min||0;
  for(const s of spec.series) for(const v of s.values) if(v!==null && v>top) top=v;
  const ymax=niceMax(top);
  const x=t=>L+pw*(t-t0)/(t1-t0), y=v=>T+ph*(1-v/ymax);
  const svg=node("svg", {viewBox:`0 0 ${W} ${H}`, width:W, height:H, "data-t0":t0, "data-t1":t1,
    "data-ymax":ymax, "data-left":L, "data-top":T, "data-width":pw, "data-height":ph, "data-step":h.step_s,
    "data-times":JSON.stringify(h.t)}, fig);
  for(const f of [0, .5, 1]){
    node("line", {class:"grid", x1:L, x2:L+pw, y1:y(f*ymax), y2:y(f*ymax)}, svg);
    node("text", {x:L-4, y:y(f*ymax)+3, "text-anchor":"end"}, svg, short(f*ymax));
  }
  node("line", {class:"axis", x1:L, x2:L+pw, y1:T+ph, y2:T+ph}, svg);
  for(const [f, anchor] of [[0,"start"], [.5,"middle"], [1,"end"]])
    node("text", {x:L+f*pw, y:H-5, "text-anchor":anchor}, svg, clock(t0+f*(t1-t0)));
  for(const m of h.marks){
    const ln=node("line", {class:"mark ev-"+m.event, x1:x(m.t).toFixed(1), x2:x(m.t).toFixed(1), y1:T, y2:T+ph,
      stroke:MARKS[m.event]||"#999", "data-event":m.event, "data-worker":m.worker, "data-t":m.t}, svg);
    node("title", {}, ln, `${clock(m.t)} ${m.worker} (${m.role}) ${m.event}`);
  }
  const legend=document.createElement("div"); legend.className="legend";
  spec.series.forEach((s, i)=>{
    const color=s.color||PALETTE[i%PALETTE.length];
    let d="", pen=false;
    s.values.forEach((v, j)=>{
      if(v===null){ pen=false; return; }
      const p=x(h.t[j]).toFixed(1)+","+y(v).toFixed(1);
      d+=pen ? "L"+p : "M"+p+"l0,0"; pen=true;  // "l0,0": a lone point shows as a dot
    });
    node("path", {class:"line", d:d, stroke:color, "data-series":s.name, "data-values":JSON.stringify(s.values)}, svg);
    const item=document.createElement("span"); item.dataset.series=s.name;
    const sw=document.createElement("i"); sw.style.background=color; item.appendChild(sw);
    item.appendChild(document.createTextNode(s.label+(s.note!==undefined ? ": "+s.note : "")));
    legend.appendChild(item);
  });
  fig.appendChild(legend);
  return fig;
}

function perSecond(h, counts){ return counts.map(c=>c/h.step_s); }
function ms(vs){ return vs.map(v=>v===null ? null : v*1000); }
function latencySpec(h, key, title){
  const w=h.latency_window[key];
  return {key:key, title:title, series:[
    {name:"p50", label:"p50", values:ms(h.latency[key].p50), note:fmt(w.p50,"ms")+" ms over the window", color:"#4a7bd0"},
    {name:"p99", label:"p99", values:ms(h.latency[key].p99), note:fmt(w.p99,"ms")+" ms over the window", color:"#d0743c"}]};
}
function workerSpec(h, key, title, scale){
  return {key:key, title:title, min:key==="kv_usage" ? 100 : 1, series:h.workers.map(w=>{
    const vs=w[key].map(v=>v===null ? null : v*scale);
    const last=[...vs].reverse().find(v=>v!==null);
    return {name:w.id, label:`${w.id} (${w.role})`, values:vs, note:last===undefined ? "-" : short(last)};
  })};
}

function drawHistory(h){
  for(const b of document.querySelectorAll("#spans button")) b.className=Number(b.dataset.window)===span ? "on" : "";
  document.getElementById("step").textContent=`one point per ${h.step_s} s, a sample every ${h.interval_s} s`;
  const tot=h.totals, routed=tot.local+tot.handoff;
  const routes=document.getElementById("routes"); routes.textContent="";
  const pct=n=>routed ? " ("+(100*n/routed).toFixed(0)+"%)" : "";
  for(const [key, label] of [["local","local prefills"],["handoff","KV handoffs"]]){
    const c=document.createElement("span"); c.dataset.key=key; c.textContent=`${label}: ${tot[key]}${pct(tot[key])}`; routes.appendChild(c);
  }
  const bar=document.createElement("div"); bar.className="mix";
  for(const [key, color] of [["local","#2e9d5b"],["handoff","#4a7bd0"]]){
    const seg=document.createElement("i"); seg.style.background=color; seg.style.width=routed ? (100*tot[key]/routed)+"%" : "0"; bar.appendChild(seg);
  }
  routes.appendChild(bar);
  const key=document.getElementById("key"); key.textContent="pool changes: ";
  for(const [ev, color] of Object.entries(MARKS)){
    const s=document.createElement("span"); const i=document.createElement("i"); i.style.background=color; s.appendChild(i);
    s.appendChild(document.createTextNode(ev)); key.appendChild(s);
  }
  const c=h.counts, note=k=>String(tot[k]);
  const specs=[
    {key:"outcomes", title:"Requests per second, by outcome (legend: count over the window)", series:[
      {name:"completed", label:"completed", values:perSecond(h,c.completed), note:note("completed"), color:"#2e9d5b"},
      {name:"failed", label:"failed", values:perSecond(h,c.failed), note:note("failed"), color:"#b00020"},
      {name:"aborted", label:"aborted", values:perSecond(h,c.aborted), note:note("aborted"), color:"#757575"},
      {name:"refused", label:"refused (admission)", values:perSecond(h,c.refused), note:note("refused"), color:"#ef6c00"},
      {name:"no_worker", label:"no worker (503)", values:perSecond(h,c.no_worker), note:note("no_worker"), color:"#7b4a2e"},
      {name:"retried", label:"prefills retried", values:perSecond(h,c.retried), note:note("retried"), color:"#a04ac0"},
      {name:"migrated", label:"migrated", values:perSecond(h,c.migrated), note:note("migrated"), color:"#c2185b"}]},
    {key:"routes", title:"Routes per second: local prefill or KV handoff", series:[
      {name:"local", label:"local prefills", values:perSecond(h,c.local), note:note("local"), color:"#2e9d5b"},
      {name:"handoff", label:"KV handoffs", values:perSecond(h,c.handoff), note:note("handoff"), color:"#4a7bd0"}]},
    latencySpec(h, "ttft", "Time to first token (ms)"),
    latencySpec(h, "itl", "Inter-token latency (ms)"),
    latencySpec(h, "handoff", "KV handoff: prefill done to the decode worker's first token (ms)"),
    {key:"sequences", title:"Sequences in flight and waiting for admission", series:[
      {name:"inflight", label:"in flight", values:h.gauges.inflight, color:"#4a7bd0"},
      {name:"queued", label:"waiting", values:h.gauges.queued, color:"#ef6c00"}]},
    workerSpec(h, "running", "Running requests per worker", 1),
    workerSpec(h, "waiting", "Waiting requests per worker", 1),
    workerSpec(h, "kv_usage", "KV-cache usage per worker (%)", 100),
  ];
  const charts=document.getElementById("charts"); charts.textContent="";
  for(const s of specs) charts.appendChild(chart(h, s));
  const ft=document.querySelector("#failures tbody"); ft.textContent="";
  for(const f of h.failures){
    const tr=document.createElement("tr"); tr.dataset.kind=f.kind; tr.dataset.worker=f.worker;
    cell(tr, clock(f.t), "l"); cell(tr, FAILS[f.kind]||f.kind, "l"); cell(tr, f.worker||"-", "l"); cell(tr, f.reason, "reason");
    ft.appendChild(tr);
  }
  if(!h.failures.length){ const tr=document.createElement("tr"); cell(tr, "none in the window", "l").colSpan=4; ft.appendChild(tr); }
  const et=document.querySelector("#events tbody"); et.textContent="";
  for(const m of [...h.marks].reverse()){
    const tr=document.createElement("tr"); tr.dataset.event=m.event; tr.dataset.worker=m.worker;
    cell(tr, clock(m.t), "l"); cell(tr, m.worker, "l"); cell(tr, m.role, "l"); cell(tr, m.event, "l "+m.event);
    et.appendChild(tr);
  }
}

async function refresh(){
  try{
    const [workers, stats, hist] = await Promise.all([fetch("/pd/workers").then(r=>r.json()),
      fetch("/pd/stats").then(r=>r.json()), fetch("/pd/history?window="+span).then(r=>r.json())]);
    const tb=document.querySelector("#workers tbody"); tb.textContent="";
    const counts={};
    for(const w of workers){
      const key=w.role+" "+w.state; counts[key]=(counts[key]||0)+1;
      const tr=document.createElement("tr"); tr.dataset.role=w.role; tr.dataset.state=w.state;
      cell(tr,w.id,"l"); cell(tr,w.duty&&w.duty!==w.role ? w.role+" \u2192 "+w.duty : w.role,"l"); cell(tr,w.state,"l "+w.state); cell(tr,w.address+":"+w.kv_port,"l");
      cell(tr,w.running); cell(tr,w.waiting); cell(tr,w.inflight);
      const kv=cell(tr,"","l"); const bar=document.createElement("span"); bar.className="bar"; bar.style.width=Math.round(w.kv_usage*100)+"px";
      kv.appendChild(bar); kv.appendChild(document.createTextNode(" "+(w.kv_usage*100).toFixed(1)+"%"));
      cell(tr,w.heartbeat_age_s.toFixed(1));
      const c=w.costs; cell(tr, c ? `step ${c.decode.step_base_ms.toFixed(1)} + ${c.decode.per_running_ms.toFixed(2)}/stream ms, prefill ${c.prefill.per_1k_tokens_ms.toFixed(0)} ms/1k (${c.decode.samples}+${c.prefill.samples} samples)` : "-", "l");
      tb.appendChild(tr);
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
    drawHistory(hist);
    document.getElementById("updated").textContent="updated "+new Date().toLocaleTimeString();
    document.getElementById("err").textContent="";
  }catch(e){ document.getElementById("err").textContent="cannot reach the controller: "+e; }
}
for(const b of document.querySelectorAll("#spans button")) b.addEventListener("click", ()=>{
  span=Number(b.dataset.window); history.replaceState(null, "", "?window="+span); refresh();
});
refresh(); setInterval(refresh, 2000);
</script></body></html>
"""
