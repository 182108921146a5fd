"""PIO, the Predictive I/O Orchestrator: the draft's routing decides which of the target's
experts are copied while the draft still runs (elb.py: the counters; planner.py: the pure
planning and chunk-sizing rules; orchestrator.py: the loop that applies them)."""
