"""decider's Kafka side: the exactly-once stream processor, its CLI and the embedded development broker.

Modules, one concern each: ``config`` (the frozen per-process configuration), ``exceptions``,
``kafka_clients`` (client settings and topic admin), ``schema_table``, ``batcher``, ``scorer`` (the
engine's device thread and prepared-schema budget), ``transactions`` (the exactly-once commit),
``dead_letters``, ``records`` (JSON files <-> Avro records <-> engine input), ``input_mapping`` (users' own
events -> states) with ``paths`` (dotted paths and templates), ``output_formats`` (avro, avro-registry, json
out, and read back), ``registry`` (the Schema Registry client and its secrets), ``loop`` (the processor),
``metrics``, ``health`` (the /metrics, /healthz, /readyz endpoint), ``logs`` (structured event logs),
``settings`` (the TOML config file and secret redaction), ``replay`` (``decider replay``), ``clients`` (what
the CLI's schema/produce/tail commands do), ``cli``, ``offline`` (``decider score``), ``embedded_broker`` and ``demo``.
"""
