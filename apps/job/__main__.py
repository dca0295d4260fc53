"""``python -m apps.job``: the main job (the README's first command, ``make demo``)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
