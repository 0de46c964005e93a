"""Every check is near-linear: no physical plan the job builds pairs rows without an equality key.

The checks are built on a small generated corpus in the shared session with the job's own
settings, and their executed physical plans are searched for the operators Spark uses for
joins without an equi-join key (a Cartesian product or a nested-loop join, broadcast or not).
"""

from __future__ import annotations

import os

from twisted.trial.unittest import TestCase

from spark.checks import CHECK_NAMES
from spark.generate import Config, generate, write_jsonl
from tests.spark._session import spark

PAIRWISE = ("CartesianProduct", "BroadcastNestedLoopJoin", "NestedLoopJoin")


def physical_plan(df) -> str:
    """The executed physical plan of ``df`` as text."""
    return df._jdf.queryExecution().executedPlan().toString()


class PhysicalPlanTests(TestCase):
    """No check's plan contains a pairwise (non-equi) join."""

    def test_no_pairwise_join_in_any_check(self):
        """Each check's violation frame, the pending count and the shared intermediates plan without pairwise joins."""
        spark()
        from spark import checks_delivery, checks_syntax
        from spark.load import load
        from spark.session import get_session
        from spark.validate_tokens import build_context, parse_args, stages

        session = get_session(shuffle_partitions=2)
        logs = os.path.abspath(self.mktemp())
        write_jsonl(generate(Config(facts=300, cache_facts=40, readers=4, tokens_per_reader=25,
                                    rooms_readers=2, seed=3)), logs)
        args = parse_args(["--logs", logs, "--out", self.mktemp()])
        inputs = load(session, logs)
        ctx = build_context(session, inputs, args)
        plans = {
            "parse_tokens": physical_plan(checks_syntax.parse_tokens(inputs.tokens, inputs.instances)),
            "components": physical_plan(checks_syntax.components(ctx.valid, ctx.writer_sids, ctx.instances)),
            "by_event": physical_plan(checks_delivery.by_event(ctx)),
        }
        for stage, dfs, pending in stages(ctx, set(CHECK_NAMES)):
            plans.update({name: physical_plan(df) for name, df in dfs.items()})
            if pending is not None:
                plans[f"{stage} pending"] = physical_plan(pending)
        self.assertEqual(set(CHECK_NAMES) - set(plans), set())
        self.assertIn("SortMergeJoin", plans["undelivered"])  # the text is the real physical plan
        for name, plan in plans.items():
            found = [op for op in PAIRWISE if op in plan]
            self.assertEqual(found, [], f"{name}: pairwise join in\n{plan}")
