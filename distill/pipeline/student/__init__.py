"""The student side: owns slots, asks for their fills, hands out what comes back checked.

Every consumer process (the :class:`StudentClient`, and each DataLoader worker of a
:class:`DistillIterableDataset`) has one :class:`SlotPool`: a medium cut into slots and a
socket to the broker's frontend. The workers write samples straight into those slots;
the pool accepts a fill only when the slot's header says it is the one asked for. See
docs/pipeline.md (Flow, Notices, Direct requests, Faults, Shared-memory sizing).

Cut by responsibility:

    pool.py       SlotPool, PoolConfig: requests, routing, direct lanes, the consumer's API
    slots.py      one record per slot and the state machine it moves through
    delivery.py   completions checked, accepted or refused with the reason
    custody.py    what waits on other processes: quarantine, declines, restarts, deadlines,
                  the writers' fair share
                  (delivery and custody move the slot table, never the pool: the pool
                  carries out what their moves queue, headers to ask and requests to send)
    inbox.py      notices from local workers, DIRECT requests to their lanes (or NoInbox)
    loans.py      samples lent as views of their slots
    client.py     StudentClient: one pool plus the control path (the leader's model switches)
    dataset.py    DistillIterableDataset: a pool per iterating process
"""

from distill.pipeline.student.client import SampleRef, StudentClient, StudentClientConfig
from distill.pipeline.student.dataset import DatasetConfig, DistillIterableDataset
from distill.pipeline.student.loans import SlotLoans
from distill.pipeline.student.pool import PoolConfig, SlotPool
from distill.pipeline.student.slots import SlotState

__all__ = ["DatasetConfig", "DistillIterableDataset", "PoolConfig", "SampleRef", "SlotLoans", "SlotPool",
           "SlotState", "StudentClient", "StudentClientConfig"]
