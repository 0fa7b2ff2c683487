"""The broker: routes slot addresses from students to workers, and completions back.

The broker never touches sample data. Its parts, each owning one decision:

    config.py    BrokerConfig: every setting and limit, typed and frozen
    service.py   Broker: lifecycle, the poll loop, the guarded routing of every message
    ingress.py   reading the sockets fairly: large messages parked per peer, bounded
    report.py    STATS answers: a cached snapshot, the same cost for 1 run or 1,000
    frontend.py  students' HELLO / REQUEST / HEARTBEAT / BYE, their liveness
    backend.py   workers' READY / DONE / HEARTBEAT / BYE, their liveness and quarantine
    control.py   leaders' SET_MODEL / STOP
    dispatch.py  queued slots -> WORKs (credit, batching, fan-out); DONEs -> COMPLETE
    runs.py      runs, their queues and counts; the ledger of outstanding requests
    records.py   one record per peer and per student connection; peer ids and mediums
                 bound to the connection that first used them
    limits.py    caps on every number a peer sends, model_cfg size, queue room
    deadline.py  measured batch times and the deadline of a WORK
    state.py     the tables, counters and sockets the parts share (replies never wait)

Slots travel through the broker in the groups they arrived in (a ``SlotRequests`` per
REQUEST, split only where a WORK ends), so the per-slot work of the broker is building
the WORK and COMPLETE lists, nothing more.
"""

from distill.pipeline.broker.config import BrokerConfig
from distill.pipeline.broker.runs import RunState
from distill.pipeline.broker.service import Broker
from distill.pipeline.protocol import DEFAULT_RUN

__all__ = ["DEFAULT_RUN", "Broker", "BrokerConfig", "RunState"]
