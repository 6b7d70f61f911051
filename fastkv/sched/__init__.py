"""Requests, queues, admission, preemption and the scheduler step."""
