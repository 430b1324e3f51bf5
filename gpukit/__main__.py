"""`python -m gpukit …` runs the `gpukit` command (see gpukit/commands/cli.py)."""

from .commands.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
