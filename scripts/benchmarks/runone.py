"""Run one repetition of one benchmark in this process and write its result as JSON.

``python -m scripts.benchmarks.runone NAME --result FILE [--quick]``

The runner starts this in a process group of its own, so a benchmark that
hangs is killed with every process it started; progress lines go to stderr.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import traceback

from scripts.benchmarks.common import ts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("name")
    p.add_argument("--result", required=True)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--label", default="")
    args = p.parse_args()
    module = importlib.import_module(f"scripts.benchmarks.{args.name}")
    tag = args.label or args.name

    def progress(msg: str) -> None:
        print(f"[bench {ts()}] {tag}: {msg}", file=sys.stderr, flush=True)

    started = time.monotonic()
    try:
        result = module.run(args.quick, progress)
        result["seconds"] = round(time.monotonic() - started, 1)
    except Exception as e:
        progress(f"FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(),
                  "seconds": round(time.monotonic() - started, 1)}
    with open(args.result, "w", encoding="utf-8") as f:
        json.dump(result, f, default=str)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    raise SystemExit(main())
