"""Applications built on moonep_ops, outside the library (run from the repository root):

  apps/job/   the main job: ``python -m apps.job`` (``make demo``), MoonEP vs plain EP training sweep
  apps/web/   the web demo of the planner: ``python apps/web/app.py`` (``make web``)
"""
