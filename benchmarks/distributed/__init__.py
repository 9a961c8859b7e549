"""The distributed strategies on one host (gloo ranks on loopback): throughput with and without
a straggler (``distributed_scaling``), the data plane against gloo baselines by model size
(``distributed_sweep``), and what a killed worker does to a job (``faults``).  Results:
docs/distributed.md, docs/data-plane.md, docs/failures.md."""
