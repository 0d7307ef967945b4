"""unbroken.diagnostics: find the bad and the slow machines.

* ``planner``: the pure bisection planner (next round's groups, or the verdict).
* ``judge``: group outcomes from check results; slow nodes by robust statistics.
* ``check``: the matmul + all-gather check workload (``python -m unbroken.diagnostics.check``).
* ``schema``: the JSON spec and result of a check (no torch).
* ``faults``: simulated faults (``--inject-fault``).
* ``runner``: the async diagnosis loop with a pluggable ``run_group``; event payloads.
* ``selfcheck``: checks a node runs alone (matmul, GPU memory, MIG, ECC, disk).

Nothing here imports unbroken.driver or unbroken.agent.
"""
