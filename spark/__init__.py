"""The PySpark token validator: proves from audit logs that no token skipped, repeated or invented a fact.

Modules:
    checks: check names, severities and violation keys (no Spark import).
    tokens: the token grammar in pure Python (shared by the reference checker and the generator).
    inputs, load: finding, reading, validating and normalising the three input tables.
    common: the run context, the violation row shape and the bucketed as-of maximum.
    checks_syntax, checks_writer, checks_tokens, checks_delivery: the Spark checks.
    report: writing violations, ``summary.json`` and ``report.md``.
    session: getting the SparkSession (local[*] unless spark-submit says otherwise).
    validate_tokens: the command line and the job (``python -m spark.validate_tokens``).
    reference: a brute-force pure-Python checker for small logs.
    generate, inject: a generator of clean logs and the anomalies injected into them.

See ``docs/validator.md``.
"""
