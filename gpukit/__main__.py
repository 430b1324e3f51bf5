"""`python -m gpukit …` runs the `gpukit` command (see gpukit/cli.py)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
