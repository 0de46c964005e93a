"""Bad input gives exit code 2 with a clear message; ``--fail-on`` picks what fails the run."""

from __future__ import annotations

import json
import os

from twisted.trial.unittest import TestCase

from tests.spark._session import spark, summary, validate, violations

T = 1_700_000_000_000_000
WRITERS = [
    {"stream": "events", "writer": "w1", "stream_id": 2, "room_id": "!a", "event_id": "$e2",
     "reserved_at": T, "completed_at": T + 5, "outcome": "ok"},
    {"stream": "events", "writer": "w1", "position": 2, "announced_at": T + 6, "kind": "position"},
]
TOKENS = [
    {"reader": "r", "stream": "events", "seq": 1, "token": "s2", "issued_at": "2023-11-14T22:13:20.5Z",
     "delivered": ["$e2"]},
    {"reader": "r", "stream": "events", "seq": 2, "token": "m2~1.1", "issued_at": T + 900_000,
     "delivered": []},
]
INSTANCES = [{"instance_id": 1, "instance_name": "w1"}]


def write(directory: str, name: str, rows: list[dict], filename: str = "part-0.jsonl") -> None:
    """Write ``rows`` as JSON Lines to ``directory/name/filename``."""
    os.makedirs(os.path.join(directory, name), exist_ok=True)
    with open(os.path.join(directory, name, filename), "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


class InputTests(TestCase):
    """The job rejects unusable input with exit code 2 and says what is wrong."""

    def setUp(self):
        spark()
        self.logs = self.mktemp()
        self.out = self.mktemp()
        write(self.logs, "writer_logs", WRITERS)
        write(self.logs, "token_logs", TOKENS)
        write(self.logs, "instance_map", INSTANCES)

    def _error(self) -> str:
        self.assertEqual(validate(self.logs, self.out, "--checks", "malformed_token"), 2)
        return summary(self.out)["error"]

    def test_missing_column(self):
        """A writer log without `completed_at` is bad input naming the column."""
        write(self.logs, "writer_logs", [{k: v for k, v in WRITERS[0].items() if k != "completed_at"}])
        self.assertIn("missing column(s) completed_at", self._error())

    def test_unreadable_parquet_file(self):
        """A file that is not Parquet under a .parquet name is bad input, not a crash."""
        os.remove(os.path.join(self.logs, "writer_logs", "part-0.jsonl"))
        with open(os.path.join(self.logs, "writer_logs", "part-0.parquet"), "wb") as fh:
            fh.write(b"this is not parquet at all" * 10)
        self.assertIn("cannot read", self._error())

    def test_unparseable_jsonl_line(self):
        """A line that is not JSON is bad input quoting the line."""
        with open(os.path.join(self.logs, "token_logs", "part-0.jsonl"), "a", encoding="utf-8") as fh:
            fh.write("{not json\n")
        self.assertIn("unreadable record(s) (first: '{not json'", self._error())

    def test_bad_timestamp(self):
        """A timestamp that is neither integer µs nor ISO-8601 is bad input."""
        write(self.logs, "writer_logs", [dict(WRITERS[0], reserved_at="yesterday")])
        self.assertIn("unparseable reserved_at", self._error())

    def test_writer_log_error_is_reported_first(self):
        """With both logs bad (they are read concurrently), the writer log's problem is the one reported."""
        write(self.logs, "writer_logs", [dict(WRITERS[0], reserved_at="yesterday")])
        with open(os.path.join(self.logs, "token_logs", "part-0.jsonl"), "a", encoding="utf-8") as fh:
            fh.write("{not json\n")
        error = self._error()
        self.assertIn("unparseable reserved_at", error)
        self.assertNotIn("not json", error)

    def test_empty_token_log(self):
        """An empty token log is inconclusive: bad input."""
        write(self.logs, "token_logs", [])
        self.assertIn("token_logs: no records (the table is empty)", self._error())

    def test_missing_table(self):
        """A missing instance_map directory is bad input."""
        os.remove(os.path.join(self.logs, "instance_map", "part-0.jsonl"))
        os.rmdir(os.path.join(self.logs, "instance_map"))
        self.assertIn("instance_map does not exist", self._error())

    def test_fail_on_warning(self):
        """A warning (a non-canonical token) passes by default and fails with --fail-on warning."""
        checks = ("--checks", "malformed_token,noncanonical_component,broken_chain")
        self.assertEqual(validate(self.logs, self.out, *checks), 0)
        s = summary(self.out)
        self.assertEqual(s["checks"]["noncanonical_component"]["count"], 1)
        self.assertEqual(s["violations"]["by_severity"], {"error": 0, "warning": 1})
        self.assertEqual(validate(self.logs, self.out, *checks, "--fail-on", "warning"), 1)
        self.assertEqual(validate(self.logs, self.out, *checks, "--fail-on", "never"), 0)


class InternalFailureTests(TestCase):
    """A failure inside a check is exit code 3 with the error in summary.json, not a crash."""

    def setUp(self):
        spark()
        self.logs, self.out = self.mktemp(), self.mktemp()
        write(self.logs, "writer_logs", WRITERS)
        write(self.logs, "token_logs", TOKENS)
        write(self.logs, "instance_map", INSTANCES)

    def _replace_check(self, name: str, fn) -> None:
        from spark import checks_writer

        self.addCleanup(checks_writer.CHECKS.__setitem__, name, checks_writer.CHECKS[name])
        checks_writer.CHECKS[name] = fn

    def test_python_exception_in_a_check(self):
        """A check raising while it builds its query makes the run exit 3, naming the error."""
        def broken(ctx):
            raise RuntimeError("check exploded")

        self._replace_check("duplicate_stream_id", broken)
        self.assertEqual(validate(self.logs, self.out), 3)
        s = summary(self.out)
        self.assertEqual(s["exit_code"], 3)
        self.assertEqual(s["error"], "internal failure: RuntimeError: check exploded")
        with open(os.path.join(self.out, "report.md"), encoding="utf-8") as fh:
            self.assertIn("INTERNAL FAILURE", fh.read())

    def test_spark_failure_in_a_check(self):
        """A check whose Spark job fails at run time makes the run exit 3 with an internal-failure error."""
        from pyspark.sql import functions as F

        from spark.common import finish

        def failing(ctx):
            df = ctx.facts.where(F.raise_error(F.lit("spark side failure")).isNull())
            return finish(df, "duplicate_stream_id", stream="stream", stream_id="sid",
                          explanation="'x'")

        self._replace_check("duplicate_stream_id", failing)
        self.assertEqual(validate(self.logs, self.out), 3)
        error = summary(self.out)["error"]
        self.assertTrue(error.startswith("internal failure: "), error)
        self.assertIn("spark side failure", error)


class AnsiOverflowTests(TestCase):
    """Under ANSI mode, numbers too large for their type make a token malformed (overflow), never a job failure."""

    def test_overflowing_tokens_are_malformed(self):
        """Overflowing minimums, positions and instance ids are `malformed_token` with reason `overflow`."""
        session = spark()
        self.assertEqual(session.conf.get("spark.sql.ansi.enabled"), "true")
        from spark import reference

        texts = ["s99999999999999999999", "m5~9999999999.6", "m99999999999999999999~1.2",
                 "m5~1.99999999999999999999", "m5~99999999999.6~"]
        logs, out = self.mktemp(), self.mktemp()
        tokens = [dict(TOKENS[0], seq=i, token=t, delivered=[] if i > 1 else ["$e2"])
                  for i, t in enumerate(["s2", *texts], 1)]
        write(logs, "writer_logs", WRITERS)
        write(logs, "token_logs", tokens)
        write(logs, "instance_map", INSTANCES)
        self.assertEqual(validate(logs, out, "--fail-on", "never"), 0, summary(out).get("error"))
        rows = [r for r in violations(out) if r["check"] == "malformed_token"]
        self.assertEqual(sorted((r["token"], r["reason"]) for r in rows),
                         sorted((t, "overflow") for t in texts))
        for r in rows:
            self.assertIn("(overflow)", r["explanation"])
        self.assertEqual(summary(out)["violations"]["total"], len(texts))
        # The reference checker's grammar agrees.
        expected = reference.check(WRITERS[:1], tokens, INSTANCES)
        self.assertEqual({k for k in expected.keys() if k[0] == "malformed_token"},
                         {("malformed_token", "events", "r", i) for i in range(2, len(texts) + 2)})


class RoomsListTests(TestCase):
    """Each distinct rooms list of a reader is loaded once, under the id its tokens carry."""

    def _load(self, tokens: list[dict]):
        from spark.load import load

        logs = self.mktemp()
        write(logs, "writer_logs", WRITERS)
        write(logs, "token_logs", tokens)
        write(logs, "instance_map", INSTANCES)
        inputs = load(spark(), logs)
        lists: dict = {}
        for r in inputs.rooms.collect():
            lists.setdefault((r["reader"], r["lid"]), set()).add(r["room"])
        by_token = {(r["reader"], r["token"], r["issued"]): r["lid"] for r in inputs.tokens.collect()}
        return lists, by_token

    def test_every_list_under_its_tokens_id(self):
        """Three tokens carrying two lists (one repeated, the later one first in seq order) give two lists."""
        rows = [dict(TOKENS[0], seq=1, token="s1", rooms=["!b", "!c"]),
                dict(TOKENS[0], seq=2, token="s2", rooms=["!a"]),
                dict(TOKENS[0], seq=3, token="s3", rooms=["!b", "!c"]),
                dict(TOKENS[0], seq=4, token="s4")]
        lists, by_token = self._load(rows)
        self.assertEqual(sorted(map(sorted, lists.values())), [["!a"], ["!b", "!c"]])
        self.assertEqual(lists[("r", by_token[("r", "s1", T + 500_000)])], {"!b", "!c"})
        self.assertEqual(lists[("r", by_token[("r", "s2", T + 500_000)])], {"!a"})
        self.assertEqual(by_token[("r", "s1", T + 500_000)], by_token[("r", "s3", T + 500_000)])
        self.assertIsNone(by_token[("r", "s4", T + 500_000)])

    def test_tied_rows_without_seq(self):
        """Without seq, two rows alike but for their lists (so their derived order is a tie) keep both lists."""
        rows = [{k: v for k, v in dict(TOKENS[0], rooms=rooms).items() if k != "seq"}
                for rooms in (["!x"], ["!y", "!z"])]
        lists, _ = self._load(rows)
        self.assertEqual(sorted(map(sorted, lists.values())), [["!x"], ["!y", "!z"]])

    def test_rows_sharing_a_seq(self):
        """Two rows with one seq and different lists keep both lists, each under its own id."""
        rows = [dict(TOKENS[0], seq=1, token="s1", rooms=["!p"]), dict(TOKENS[0], seq=1, token="s2", rooms=["!q"])]
        lists, by_token = self._load(rows)
        self.assertEqual(lists[("r", by_token[("r", "s1", T + 500_000)])], {"!p"})
        self.assertEqual(lists[("r", by_token[("r", "s2", T + 500_000)])], {"!q"})
