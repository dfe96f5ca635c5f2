"""`pdserve bench`: disaggregated against colocated serving on this machine, same cores, same model.

workload.py  request classes, lengths and arrival times (pure, seeded)
client.py    vLLM's own benchmark client, run in a subprocess on a trace of that workload
metrics.py   per-request records -> TTFT / TPOT / ITL / E2E percentiles, throughput, goodput (pure)
procs.py     CPU time of process groups from /proc (idle CPU per worker, controller CPU)
cluster.py   one configuration at a time: a controller + workers, or vLLM's plain server
report.py    JSON, a Markdown table and PNG plots
main.py      the command: configurations x rates; overhead.py: `pdserve bench overhead`
"""
