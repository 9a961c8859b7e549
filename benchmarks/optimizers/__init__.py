"""The optimizers' step: time, bandwidth and peak memory of every optimizer on every path
(``optimizer_speed``), the per-parameter cost of a step (``step_overhead``), and what both
measure on (``speed_setup``).  Results: docs/speed.md."""
