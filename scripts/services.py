#!/usr/bin/env python3
"""Check (and start, if installed but down) the services synflow's tests use.

Usage: python scripts/services.py ensure
Prints one line per service; exits 1 if any is unreachable.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tests import services


def ensure() -> int:
    ok = True
    checks = [
        ("PostgreSQL", f"{services.PG_HOST}:{services.PG_PORT}", services.require_postgres),
        ("Redis", f"{services.REDIS_HOST}:{services.REDIS_PORT}", services.require_redis),
        ("Java/Spark", "java + pyspark", services.require_java),
    ]
    for name, where, check in checks:
        try:
            check()
        except BaseException as e:  # SkipTest or AssertionError from the helpers
            ok = False
            print(f"  {name:<11} {where:<16} UNAVAILABLE: {e}")
        else:
            print(f"  {name:<11} {where:<16} ok")
    return 0 if ok else 1


if __name__ == "__main__":
    if sys.argv[1:] != ["ensure"]:
        sys.exit(__doc__)
    sys.exit(ensure())
