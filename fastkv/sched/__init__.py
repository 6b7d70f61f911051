"""Requests, queues, admission, preemption and the scheduler step.

The engine uses ``Scheduler`` (scheduler.py) with ``Request`` (request.py). The scheduler's
state has one owner per piece: the request table (table.py, the only caller of state
transitions), the copy outbox (outbox.py) and one step's batch (batch.py). The role modules,
admission, preemption, reservation (disaggregated decode), weights (weight update) and
integrity, take those (parts.py) and never the Scheduler; queues and cost are their policies.
"""
from fastkv.sched.config import SchedulerConfig
from fastkv.sched.output import SchedulerOutput
from fastkv.sched.queues import QueuePolicy
from fastkv.sched.request import PreemptionMode, Request, RequestState
from fastkv.sched.reservation import Refusal, RefusalReason, Reservation
from fastkv.sched.scheduler import Scheduler
from fastkv.sched.stats import SchedulerStats
from fastkv.sched.weights import WeightUpdate

__all__ = ["PreemptionMode", "QueuePolicy", "Refusal", "RefusalReason", "Request", "RequestState", "Reservation",
           "Scheduler", "SchedulerConfig", "SchedulerOutput", "SchedulerStats", "WeightUpdate"]
