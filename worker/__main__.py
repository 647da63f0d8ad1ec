"""``python -m worker ...`` is the ``decider`` command."""

from worker.cli.app import main

main()
