"""The ``shmkv`` command line, run in the user's process: every subcommand, and the state
file of ``export`` / ``import``."""

from shmkv.cli.main import main

__all__ = ["main"]
