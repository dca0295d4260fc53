"""The main job (``python -m apps.job``): MoonEP vs plain all-to-all EP, trained on R ranks.

  cli.py           argument parsing and checks, launch (spawned gloo ranks or torchrun)
  run.py           one rank: build, compile, warm up, sweep maxvio; the launchers
  model.py         the Kimi-K3-like MoE stack, ForcedRouter (imposed imbalance), weights, data
  stats.py         per-routing accounting from the planner's tables (loads, slots, bytes)
  report.py        table, results.json, sweep.md, PNG plots
  planner_demo.py  --planner-only: the planner alone over simulated ranks
"""
