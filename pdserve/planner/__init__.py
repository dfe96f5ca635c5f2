"""Adaptive P/D: cost models, per-request placement, role planning, simulation (pure, no engine).

- costmodel.py: a worker's prefill and decode-step times, fit online (seeded from a Profile).
- capacity.py: closed-form queueing predictions for a pool split into prefill/decode/both.
- placement.py: one request: local or disaggregated, on which workers, against an SLO.
- roles.py: roles for `--role auto` workers, with hold and cooldown (fake clock in tests).
- sim.py: a discrete-event simulation of a pool under a workload, for `pdserve plan`.
- plan.py: `pdserve plan`: fit a Profile from a bench results folder, simulate, recommend.
"""
