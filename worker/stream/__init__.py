"""The stream wing: the exactly-once loop and what it drives, in the order a state meets them. ``loop`` (poll ->
decode -> route -> batch -> score -> records -> transaction), ``assignment`` (where states come from: the consumer
group), ``schema_table`` (the schemas topic as a table), ``routing`` (which batch a state joins), ``batcher`` (the open
cycle's bookkeeping), ``closing`` (when the open cycle closes) with ``latency_budget`` (closing under
--latency-budget-ms) and its ``gathering`` window, ``scorer`` (the engine's device thread, tokenizer pool and
prepared-schema budget) with ``tokenizing`` (the states routed together tokenized as one job), ``inflight``
(the cycles being scored and committed, and the loop's wait on them), ``outputs`` (a cycle's records, in input order),
``transactions`` (the exactly-once commit) with its ``watchdog``, ``gc_pauses`` (the garbage collector kept out of the
latency) and ``replay`` (the loop over a fixed range)."""
