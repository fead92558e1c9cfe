"""``python -m shmkv``: the command line."""

from shmkv.cli.main import main

main()
