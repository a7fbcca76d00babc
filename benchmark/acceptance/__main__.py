"""`python -m benchmark.acceptance`: see `benchmark/acceptance/run.py`."""

from __future__ import annotations

from benchmark.acceptance.run import main

raise SystemExit(main())
