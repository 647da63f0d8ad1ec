"""The development broker wing: ``embedded_broker`` (the noida-db Kafka broker behind ``decider broker`` and
``decider demo``) and ``reaper`` (its clean-up, which outlives a SIGKILL of the process that started it). For
development and tests only: nothing below the CLI imports it."""
