"""Scheduling inside the pool: sequences, admission (shared blocks first), batching, preemption."""
