"""decider's Kafka side: the exactly-once stream processor, its CLI and the embedded development broker.

Modules, one concern each, in the order a state meets them:
``loop`` (the processor: poll -> decode -> route -> batch -> score -> records -> transaction),
``assignment`` (where states come from: the consumer group), ``records`` (the record types and conversions:
source record, decoded state, dead-letter reasons, output records), ``routing`` (which batch a
state joins, kept right as schemas change), ``schema_table`` (the schemas topic as a table), ``batcher`` (the
open cycle's bookkeeping), ``scorer`` (the engine's device thread, tokenizer pool and prepared-schema budget),
``outputs`` (a cycle's probability records and dead letters, in input order), ``transactions`` (the exactly-once
commit). Around it: ``config`` (the frozen per-process configuration), ``config_file`` (the TOML config file and
secret redaction), ``exceptions``, ``kafka_clients`` (client settings and topic admin), ``metrics``, ``liveness``
(whether the broker answers and whether a call on it is stuck), ``health`` (the /metrics, /healthz, /readyz
endpoint), ``logs`` (structured event logs), ``gc_pauses``, ``ops`` (running a
loop as an operated process), ``replay`` (``decider replay``: the loop over a fixed range), ``cli`` and
``cli_options`` (the command line and its shared options), ``commands`` (what the CLI's schema/produce/tail
commands do), ``offline`` (``decider score``), ``user_files`` (reading users' schema and states files, with one-line
errors), ``input_mapping`` (users' own events -> states) with ``paths`` (dotted paths and templates),
``output_formats`` (avro, avro-registry, json out, and read back), ``registry`` (the Schema Registry client and
its secrets), ``embedded_broker`` (with ``reaper``, clean-up that outlives a SIGKILL, and ``ports``, who holds a local
port) and ``demo``.
"""
