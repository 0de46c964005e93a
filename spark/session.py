"""Getting the SparkSession: local[*] by default, whatever spark-submit configured otherwise."""

from __future__ import annotations

import os
from collections.abc import Mapping

from pyspark.sql import SparkSession

DEFAULT_LOCAL_SHUFFLE_PARTITIONS = 16
KRYO = "org.apache.spark.serializer.KryoSerializer"
LOCAL_DRIVER_JAVA_OPTIONS = "-XX:+UseParallelGC"
#: Generated classes a session keeps compiled (``spark.sql.codegen.cache.maxEntries``; Spark's default is 100).
CODEGEN_CACHE_ENTRIES = 4000


#: Classes PySpark reaches through py4j's imports by a short name (``jvm.functions.col`` for every
#: column named by a string, ``jvm.PythonUtils.toSeq`` for every list of columns). py4j resolves a
#: short name on every access: a round trip to the JVM, which first tries the name as a class of
#: its own and so searches every jar on the class path before trying the imports. A validator run
#: does that thousands of times, about a fifth of a run's CPU on small logs.
SHORT_NAMES = {
    "functions": "org.apache.spark.sql.functions",
    "PythonUtils": "org.apache.spark.api.python.PythonUtils",
    "PythonSQLUtils": "org.apache.spark.sql.api.python.PythonSQLUtils",
    "PythonErrorUtils": "org.apache.spark.api.python.PythonErrorUtils",
    "PythonRDD": "org.apache.spark.api.python.PythonRDD",
    "SerDeUtil": "org.apache.spark.api.python.SerDeUtil",
}


def resolve_short_names(spark: SparkSession) -> None:
    """Resolve :data:`SHORT_NAMES` once on the session's py4j view, so later accesses need no lookup.

    The view keeps the class objects as attributes (what a lookup would return each time); a
    session without a py4j view (Spark Connect) is left as it is.
    """
    jvm = getattr(spark.sparkContext, "_jvm", None)
    if jvm is None:
        return
    known = vars(jvm)
    for short, qualified in SHORT_NAMES.items():
        if short not in known:
            known[short] = getattr(jvm, qualified)


def chooses_collector(java_options: str) -> bool:
    """Whether JVM options name a garbage collector (``-XX:+UseSerialGC``, ``-XX:+UseG1GC``…)."""
    return any(opt.startswith("-XX:+Use") and opt.endswith("GC") for opt in java_options.split())


def launched_by_spark_submit() -> bool:
    """True when this Python process was started by spark-submit (the JVM already runs)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def choose_master(master: str | None, submitted: bool, env: Mapping[str, str]) -> str | None:
    """The master a new session is built with (None: leave it to spark-submit's configuration).

    Args:
        master: the ``--master`` option, which wins when given.
        submitted: whether spark-submit started this process (it has set the master already).
        env: the environment (``SPARK_MASTER`` is used when not under spark-submit).

    Returns:
        ``master``; else None under spark-submit; else ``SPARK_MASTER``; else ``local[*]``.
    """
    if master:
        return master
    if submitted:
        return None
    return env.get("SPARK_MASTER") or "local[*]"


def get_session(
    master: str | None = None,
    shuffle_partitions: int | None = None,
    driver_memory: str | None = None,
    app_name: str = "synflow-validate-tokens",
) -> SparkSession:
    """Return the active SparkSession, or start one.

    An already active session (the tests' shared one, or spark-submit's) is reused; only runtime
    SQL settings are applied to it. A new session uses ``master`` if given; otherwise the master
    that spark-submit or ``SPARK_MASTER`` set; otherwise ``local[*]``.

    Args:
        master: the Spark master URL, overriding everything else.
        shuffle_partitions: ``spark.sql.shuffle.partitions`` (default for a new session with a
            local master and no configured value: 16; AQE coalesces).
        driver_memory: ``spark.driver.memory`` for a driver JVM this process launches.
        app_name: the application name.

    Returns:
        The session, with the session time zone set to UTC.
    """
    spark = SparkSession.getActiveSession()
    if spark is None:
        builder = SparkSession.builder.appName(app_name)
        submitted = launched_by_spark_submit()
        chosen = choose_master(master, submitted, os.environ)
        if chosen:
            builder = builder.master(chosen)
        if chosen and chosen.startswith("local"):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            builder = builder.config("spark.ui.enabled", "false")
            builder = builder.config("spark.ui.showConsoleProgress", "false")
        if driver_memory and not submitted:
            builder = builder.config("spark.driver.memory", driver_memory)
        if not submitted:
            # Checkpointed rows are kept serialized; Kryo writes them with less work per row
            # than Java serialization. spark-submit's own configuration is left as it is.
            builder = builder.config("spark.serializer", KRYO)
            # One validator run compiles about 670 generated classes, against Spark's default cache
            # of 100: a session that validates twice (the demo's two deployments) or runs a plan
            # again would compile them all again.
            builder = builder.config("spark.sql.codegen.cache.maxEntries", str(CODEGEN_CACHE_ENTRIES))
        if (not submitted and chosen and chosen.startswith("local")
                and not chooses_collector(os.environ.get("SPARK_SUBMIT_OPTS", ""))):
            # A local driver is the whole job: the throughput collector (no concurrent marking
            # threads competing with the tasks for a few cores) ran the 10M bench about 10% faster.
            # A collector chosen in SPARK_SUBMIT_OPTS is kept (the JVM refuses two).
            builder = builder.config("spark.driver.extraJavaOptions", LOCAL_DRIVER_JAVA_OPTIONS)
        spark = builder.getOrCreate()
        spark.sparkContext.setLogLevel("WARN")
        # A local master (ours, or spark-submit's --master local[…]) gets the local shuffle
        # default unless the configuration sets one: Spark's 200 partitions cost more in task
        # overhead than they save on a few cores.
        conf = spark.sparkContext.getConf()
        if (shuffle_partitions is None and (spark.sparkContext.master or "").startswith("local")
                and not conf.contains("spark.sql.shuffle.partitions")):
            shuffle_partitions = DEFAULT_LOCAL_SHUFFLE_PARTITIONS
    resolve_short_names(spark)
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    # ANSI mode (Spark 4's default) is set explicitly: token parsing is written for it (regular
    # expressions first, then try_cast only), so a bad token is reported, never a job failure.
    spark.conf.set("spark.sql.ansi.enabled", "true")
    # Only the joins the checks mark with an explicit broadcast hint (small per-reader tables) are
    # broadcast: size estimates of checkpointed and aggregated inputs can be far below their real
    # size, and an automatic broadcast of one of them exhausts the driver's memory at 10M rows.
    spark.conf.set("spark.sql.autoBroadcastJoinThreshold", "-1")
    spark.conf.set("spark.sql.adaptive.autoBroadcastJoinThreshold", "-1")
    if shuffle_partitions:
        spark.conf.set("spark.sql.shuffle.partitions", str(shuffle_partitions))
    return spark
