"""The leaders' socket: SET_MODEL and STOP (STATS is the service's).

Only the leader switches a run's model: SET_MODEL carries the leader's epoch, and one
older than the newest the run has seen (a stale leader) is refused. A leader uses a
short-lived connection per command, so SET_MODEL is bound by the epoch, not by a
connection. A ``model_cfg`` is within the protocol's depth and size (``decode``), the
broker's ``max_model_cfg_bytes``, and what all runs may keep together
(``max_retained_cfg_bytes``); a refused SET_MODEL leaves the run as it was.
"""

from __future__ import annotations

import logging

from distill.pipeline.broker import limits
from distill.pipeline.broker.runs import RunState
from distill.pipeline.broker.state import BrokerState
from distill.pipeline.protocol import Command, ProtocolError

log = logging.getLogger(__name__)


class Control:
    """Leader handlers."""

    def __init__(self, state: BrokerState) -> None:
        self.state = state

    def on_set_model(self, identity: bytes, key: str | None, body: dict) -> None:
        state = self.state
        run = state.runs.get_or_add(body["run_id"], state.busy_runs)
        self._check_leader(run, body["leader_epoch"], body["peer_id"])
        restore = body.get("restore_generation")
        floor = body.get("min_generation") or 0  # a switch: above every generation the leader knows
        limits.check_generation_room(run.run_id, run.generation, max(restore or 0, floor))
        model_cfg = body.get("model_cfg")
        state.runs.set_model(run, body["model_id"], model_cfg, limits.cfg_cost(state.config, model_cfg))
        if restore is not None and restore >= run.generation:
            run.generation = restore  # a leader re-joining a restarted broker
        else:
            run.generation = max(run.generation + 1, floor)
        run.share_model = bool(body.get("share_model"))
        log.info("run %s: model %s, generation %d", run.run_id, run.model_id, run.generation)
        state.send.publish(Command.MODEL, {"run_id": run.run_id, "generation": run.generation,
                                           "model_id": run.model_id, "model_cfg": run.model_cfg},
                           topic=run.run_id.encode())
        state.send.to_leader(identity, Command.MODEL_SET, {
            "run_id": run.run_id, "generation": run.generation, "model_id": run.model_id,
        })

    def _check_leader(self, run: RunState, epoch: int, peer_id: str) -> None:
        """Accept the newest leader; refuse an older one, or a second one of the same epoch."""
        if epoch < run.leader_epoch or (epoch == run.leader_epoch and peer_id != run.leader_id):
            self.state.counters.refused += 1
            raise ProtocolError(f"run {run.run_id}: {peer_id} (epoch {epoch}) is not the leader; "
                                f"{run.leader_id} (epoch {run.leader_epoch}) is")
        if peer_id != run.leader_id and run.leader_id is not None:
            log.info("run %s: leader %s (epoch %d) replaces %s (epoch %d)", run.run_id, peer_id,
                     epoch, run.leader_id, run.leader_epoch)
        self.state.runs.set_leader(run, epoch, peer_id)

    def on_stop(self, identity: bytes, key: str | None, body: dict) -> None:
        """Publish STOP to the workers (of one run, or all); answered with the stats."""
        state = self.state
        run_id = body.get("run_id")
        log.info("stop requested for %s", run_id or "all workers")
        state.send.publish(Command.STOP, {"run_id": run_id}, topic=(run_id or "").encode())
        state.send.to_leader(identity, Command.STATS_REPLY, {"stats": state.snapshot().to_dict()})
