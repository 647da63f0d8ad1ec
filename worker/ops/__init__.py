"""The operations wing: what the process tells its operators. Prometheus ``metrics``, the broker's ``liveness``
(reachable, a call stuck), the ``health`` endpoint (/metrics, /healthz, /readyz), structured event ``logs``, and
``ports`` (who holds a local port, for "address in use" messages). Imports nothing of the worker but ``exceptions``,
so every other wing may report here."""
