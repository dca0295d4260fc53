"""The main job: ``python -m moonep_ops`` (the README's first command, ``make demo``).

See moonep_ops/job/cli.py (``python -m moonep_ops --help``).
"""
import sys

from .job.cli import main

if __name__ == "__main__":
    sys.exit(main())
