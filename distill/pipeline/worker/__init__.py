"""The worker: fills student slots on request (see ``loop.py``).

Cut by responsibility: ``loop.py`` (sockets, heartbeats, broadcasts, the request lane's
turn), ``batches.py`` (a batch filled, committed, DONE or answered; the deferred commit;
fan-out), ``fill.py`` (WORK items -> claimed targets -> the sample function), ``commit.py`` (headers over
standing claims), ``claims.py`` (one writer per slot fill), ``segments.py`` (mapped
segments, checked against their own headers), ``direct.py`` (the request lane and notices, or ``NoLane``) and
``config.py`` (:class:`WorkerConfig`).
"""

from distill.pipeline.worker.config import BatchFn, GeneratorFn, SlotTarget, WorkerConfig
from distill.pipeline.worker.loop import Worker

__all__ = ["BatchFn", "GeneratorFn", "SlotTarget", "Worker", "WorkerConfig"]
