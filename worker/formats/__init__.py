"""The formats wing: what records are and how they are read and written. ``records`` (the record types and
conversions: source record, decoded state, dead-letter reasons, output records), ``input_mapping`` (how users' own
events become states: the settings) and ``input_decoder`` (applying them, record by record) with ``paths`` (dotted
paths and templates), ``output_formats`` (avro, avro-registry and json out, and read back) and ``registry`` (the
Schema Registry client and its secrets). Knows nothing of the loop."""
