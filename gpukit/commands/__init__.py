"""The `gpukit` command's wing: what the shell runs, not what a learner's notebook imports.

    gpukit doctor | lab | lessons | train | site | gpu-check | nbval-sanitize-path   (cli.py)

cli.py parses the command line; gpucheck.py, gpulease.py and gpuledger.py check gpukit on a GPU and plan short leases;
site.py builds the lessons' static site; jupyter.py and lab_contents.py open the lessons in JupyterLab; nbval.py and
nbval_outputs.py serve nbval. Nothing else in gpukit imports this folder (tests/test_layout.py keeps it so): the
modules a learner reads stay free of the shell's concerns, and `import gpukit` never loads them.
"""

import importlib

__all__ = ["main"]


def __getattr__(name: str):
    # `main` (the `gpukit` command) on first use: the JupyterLab server and nbval's plugin import this folder's small
    # modules without loading torch through cli.py.
    if name == "main":
        return importlib.import_module(f"{__name__}.cli").main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
