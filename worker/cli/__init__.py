"""The command-line wing: the ``decider`` command. ``app`` (the commands and ``main``, the console script), ``options``
(the options commands share, each with its environment variable), ``commands`` (what schema, produce and tail do),
``operated`` (running a loop as an operated process: signals, logs, metrics, health), ``offline`` (``decider score``),
``demo`` (``decider demo``) and ``user_files`` (users' schema and states files, with one-line errors). The top wing:
it may import every other."""
