"""``python -m scripts.benchmarks`` -- what ``scripts/bench`` runs."""

from scripts.benchmarks.runner import main

raise SystemExit(main())
