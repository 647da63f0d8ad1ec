"""decider's Kafka side: the exactly-once stream processor, its CLI and the embedded development broker.

Wings, bottom to top; a module imports only from its own wing or a lower one (``tests/test_architecture.py``):

``exceptions`` (the error types and their exit codes) < ``ops`` (metrics, broker liveness, the /healthz endpoint,
structured logs, local ports) < ``config_file`` (the TOML file and secret redaction) < ``formats`` (record types,
users' input mapping, output formats, the Schema Registry client) < ``config`` (the frozen per-process configuration)
< ``kafka_clients`` (client settings and topic admin) < ``stream`` (the loop: poll -> decode -> route -> batch ->
score -> records -> transaction, and replay) < ``devbroker`` (the embedded development broker) < ``cli`` (the
``decider`` command line: ``worker.cli.app``).

``config``, ``config_file``, ``exceptions`` and ``kafka_clients`` are single modules at this level; the others are
sub-packages, each ``__init__`` saying what its wing owns. ``python -m worker`` is the ``decider`` command.
"""
