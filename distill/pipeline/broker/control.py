"""The leaders' socket: SET_MODEL and STOP (STATS is the service's).

A run's leader is whoever holds the run's secret, never whoever sends the larger
number: the first SET_MODEL of a run without a leader on this broker *claims* it (the
run keeps a hash of the secret), and every later SET_MODEL or STOP without the secret
is refused. Numbers in a leader's message move the run by one step at most
(``Control._step``); only a claim adopts the leader's own numbers, its generation
bounded by ``MAX_CLAIMED_GENERATION``. A ``model_cfg`` is bounded by ``decode``,
``max_model_cfg_bytes`` and ``max_retained_cfg_bytes``; a refused SET_MODEL leaves the
run as it was. See docs/security.md, section Leaders, roles and numbers (issue 37).
"""

from __future__ import annotations

import hashlib
import hmac
import logging

from distill.pipeline import protocol
from distill.pipeline.broker import limits
from distill.pipeline.broker.runs import RunState
from distill.pipeline.broker.state import BrokerState
from distill.pipeline.protocol import TAKE_OVER_EPOCH, Command, ProtocolError

log = logging.getLogger(__name__)

MIN_LEADER_SECRET_CHARS = 16
"""A leader secret shorter than this is refused (a guessable secret binds nothing)."""
MAX_CLAIMED_GENERATION = 2**62
"""The largest generation a claim may start a run at: a run's numbers stay far from the
wire's maximum (2**63-1), whoever claims it first."""


def secret_hash(secret: str | None) -> bytes:
    """What the broker keeps of a leader secret (never the secret itself)."""
    if secret is None or len(secret) < MIN_LEADER_SECRET_CHARS:
        raise ProtocolError(f"leader_secret missing or shorter than {MIN_LEADER_SECRET_CHARS} characters "
                            "(StudentClient makes one: secrets.token_hex(16))")
    return hashlib.sha256(secret.encode()).digest()


class Control:
    """Leader handlers."""

    def __init__(self, state: BrokerState) -> None:
        self.state = state

    def on_set_model(self, identity: bytes, key: str | None, body: dict) -> None:
        state = self.state
        run = state.runs.get_or_add(body["run_id"], state.busy_runs)
        claim = run.leader_key is None
        leader_key = secret_hash(body.get("leader_secret"))
        restore = body.get("restore_generation")
        floor = body.get("min_generation") or 0  # a switch: above every generation the leader knows
        limits.check_generation_room(run.run_id, run.generation, max(restore or 0, floor))
        if claim:
            epoch, generation = self._claim_numbers(run, body["leader_epoch"], restore, floor)
        else:
            epoch = self._check_leader(run, leader_key, body["leader_epoch"], body["peer_id"])
            generation = self._next_generation(run, restore, floor)
        model_cfg = body.get("model_cfg")
        state.runs.set_model(run, body["model_id"], model_cfg, limits.cfg_cost(state.config, model_cfg))
        self._bind_leader(run, leader_key, epoch, body["peer_id"], claim)
        run.generation = generation
        run.fan_out = bool(body.get("share_model"))  # the wire keeps its name: peers of other versions send it
        log.info("run %s: model %s, generation %d", run.run_id, run.model_id, run.generation)
        state.send.publish(Command.MODEL, {"run_id": run.run_id, "generation": run.generation,
                                           "model_id": run.model_id, "model_cfg": run.model_cfg},
                           topic=run.run_id.encode())
        state.send.to_leader(identity, Command.MODEL_SET, {
            "run_id": run.run_id, "generation": run.generation, "model_id": run.model_id,
            "leader_epoch": run.leader_epoch,
        })

    def _claim_numbers(self, run: RunState, epoch: int, restore: int | None, floor: int) -> tuple[int, int]:
        """A run without a leader here: adopt the leader's epoch and generation, bounded."""
        wanted = max(restore or 0, floor)
        if wanted > MAX_CLAIMED_GENERATION or epoch >= MAX_CLAIMED_GENERATION:
            self._refuse(f"run {run.run_id}: a leader claiming the run may not start it at generation "
                         f"{wanted} or epoch {epoch} (at most {MAX_CLAIMED_GENERATION})")
        generation = restore if restore is not None and restore >= run.generation \
            else max(run.generation + 1, floor)
        return max(epoch, 1), generation

    def _check_leader(self, run: RunState, leader_key: bytes, epoch: int, peer_id: str) -> int:
        """The epoch a holder of the run's secret leads at; refuse a stranger, a stale or
        twin leader, and an epoch past the next."""
        assert run.leader_key is not None
        if not hmac.compare_digest(leader_key, run.leader_key):
            self._refuse(f"run {run.run_id}: {peer_id[:64]} is not its leader (the run's leader "
                         "secret does not match; a restarted leader passes leader_secret=)")
        if epoch == TAKE_OVER_EPOCH:
            return run.leader_epoch if peer_id == run.leader_id else run.leader_epoch + 1
        if epoch < run.leader_epoch or (epoch == run.leader_epoch and peer_id != run.leader_id):
            self._refuse(f"run {run.run_id}: {peer_id[:64]} (epoch {epoch}) is not the leader; "
                         f"{run.leader_id} (epoch {run.leader_epoch}) is")
        return self._step(run, "leader epoch", epoch, run.leader_epoch)

    def _next_generation(self, run: RunState, restore: int | None, floor: int) -> int:
        """A led run's next generation: one step, whatever the leader asked for."""
        if restore is not None:
            restore = self._step(run, "restore_generation", restore, run.generation)
            if restore >= run.generation:
                return restore
        self._step(run, "min_generation", floor, run.generation)
        return run.generation + 1

    def _bind_leader(self, run: RunState, leader_key: bytes, epoch: int, peer_id: str, claim: bool) -> None:
        """Record who leads ``run`` now. A claim is every run's start (info); a hand-over to
        another process is rarer and worth a look (a restarted leader, or someone else)."""
        if claim:
            log.info("run %s: claimed by leader %s (epoch %d); only holders of its secret lead it now",
                        run.run_id, peer_id[:64], epoch)
        elif peer_id != run.leader_id:
            log.warning("run %s: leader hands over from %s (epoch %d) to %s (epoch %d)", run.run_id,
                        run.leader_id, run.leader_epoch, peer_id[:64], epoch)
        self.state.runs.set_leader(run, epoch, peer_id, leader_key)

    def on_stop(self, identity: bytes, key: str | None, body: dict) -> None:
        """Publish STOP to the workers (of one run, or all); answered with the stats.

        Only a run's leader stops it, and a STOP of all workers only the leader of every
        run that has one (it stops their workers too)."""
        state = self.state
        run_id = body.get("run_id")
        self._check_stop(run_id, body.get("leader_secret"))
        log.info("stop requested for %s", run_id or "all workers")
        state.send.publish(Command.STOP, {"run_id": run_id}, topic=(run_id or "").encode())
        stats = state.snapshot(top_runs=protocol.STATS_TOP_RUNS)
        state.send.to_leader(identity, Command.STATS_REPLY, {"stats": stats.to_dict()})

    def _check_stop(self, run_id: str | None, secret: str | None) -> None:
        runs = self.state.runs.runs
        targets = [runs[run_id]] if run_id in runs else [] if run_id is not None else list(runs.values())
        led = [run for run in targets if run.leader_key is not None]
        if not led:
            return
        key = secret_hash(secret)
        for run in led:
            if not hmac.compare_digest(key, run.leader_key):  # type: ignore[arg-type]
                self._refuse(f"STOP refused: run {run.run_id} has a leader, and this is not its secret")

    def _refuse(self, reason: str) -> None:
        """Count and raise: the service logs the reason and answers it with an ERROR."""
        self.state.counters.refused += 1
        raise ProtocolError(reason)

    def _step(self, run: RunState, what: str, value: int, current: int) -> int:
        """``value`` if it is ``current`` or the next; refuse a jump (a peer's choice)."""
        if value > current + 1:
            self._refuse(f"run {run.run_id}: {what} {value} jumps past {current + 1}: numbers move by "
                         "one step; only a leader claiming a run that has none here sets them")
        return value
