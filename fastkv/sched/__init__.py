"""Requests, queues, admission, preemption and the scheduler step.

The engine uses ``Scheduler`` (scheduler.py) with ``Request`` (request.py); the other modules
are its roles: queues, admission, preemption, reservation (disaggregated decode), cost
(auto preemption), weights (weight update), integrity.
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
