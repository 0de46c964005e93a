"""The validator's own session settings, checked in the tests' shared session.

Apart from :mod:`tests.spark.test_cli` (which starts its own JVMs and needs no shared
session, so that it runs in the suite's main lane).
"""

from __future__ import annotations

from twisted.trial.unittest import TestCase


class SessionSettingsTests(TestCase):
    def test_session_broadcasts_only_hinted_joins(self):
        """The job's session never broadcasts a join on a size estimate (at 10M rows that exhausted the driver)."""
        from spark.session import get_session
        from tests.spark._session import spark

        session = get_session(shuffle_partitions=2) if spark() else None
        assert session is not None
        self.assertEqual(session.conf.get("spark.sql.autoBroadcastJoinThreshold"), "-1")
        self.assertEqual(session.conf.get("spark.sql.adaptive.autoBroadcastJoinThreshold"), "-1")
        self.assertEqual(session.conf.get("spark.sql.session.timeZone"), "UTC")

    def test_job_session_runs_in_ansi_mode(self):
        """The job's session turns ANSI mode on (its token parsing is written to never throw under it)."""
        from spark.session import get_session
        from tests.spark._session import spark

        spark().conf.set("spark.sql.ansi.enabled", "false")
        self.addCleanup(spark().conf.set, "spark.sql.ansi.enabled", "true")
        self.assertEqual(get_session(shuffle_partitions=2).conf.get("spark.sql.ansi.enabled"), "true")

    def test_short_names_resolved_once(self):
        """The job's session keeps PySpark's short-named JVM classes on its py4j view: no lookup per column."""
        from spark.session import SHORT_NAMES, get_session
        from tests.spark._session import spark

        jvm = spark().sparkContext._jvm
        for short in SHORT_NAMES:
            vars(jvm).pop(short, None)  # as a session no job has used yet
        session = get_session(shuffle_partitions=2)
        self.assertIs(session.sparkContext._jvm, jvm)
        for short, qualified in SHORT_NAMES.items():
            self.assertIn(short, vars(jvm))
            # The same class a lookup through py4j's imports finds.
            self.assertEqual(getattr(jvm, short)._fqn, qualified)
        # Columns built through the kept names work as before.
        from pyspark.sql import functions as F

        row = session.range(3).select(F.sum("id").alias("s"), F.max(F.col("id")).alias("m")).first()
        self.assertEqual((row["s"], row["m"]), (3, 2))
