"""decider's Kafka side: the exactly-once stream processor, its CLI and the embedded development broker.

Modules, one concern each: ``config`` (the frozen per-process configuration), ``exceptions``,
``kafka_clients`` (client settings and topic admin), ``schema_table``, ``batcher``, ``scorer`` (the
engine's device thread and prepared-schema budget), ``transactions`` (the exactly-once commit),
``dead_letters``, ``records`` (JSON files <-> Avro records <-> engine input), ``user_files`` (reading users'
schema and states files, with one-line errors), ``loop`` (the processor),
``metrics``, ``health`` (the /metrics, /healthz, /readyz endpoint), ``logs`` (structured event logs),
``settings`` (the TOML config file and secret redaction), ``replay`` (``decider replay``), ``clients`` (what
the CLI's schema/produce/tail commands do), ``cli``, ``offline`` (``decider score``), ``embedded_broker`` (with ``reaper``, clean-up that outlives a
SIGKILL, and ``ports``, who holds a local port) and ``demo``.
"""
