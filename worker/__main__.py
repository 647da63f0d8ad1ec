"""``python -m worker ...`` is the ``decider`` command."""

from worker.cli import main

main()
