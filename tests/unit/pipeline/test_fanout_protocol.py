"""Fan-out messages: a WORK of several runs (``runs``, ``copies``) and the
``share_model`` opt-in; malformed ones are refused by the decoder or the worker."""

from __future__ import annotations

import msgpack
import pytest

from distill.pipeline.protocol import PROTOCOL_TAG, Command, ProtocolError, decode, encode
from distill.pipeline.worker.batches import rehome_sources
from distill.pipeline.worker.fill import shared_sources

SHARED_WORK = {"work_id": 4, "run_id": "a", "generation": 2, "model_id": "layer_0", "model_cfg": {"layers": [0]},
               "items": [["dst_a", 0, 4160, 9], ["dst_a", 1, 4160, 10], ["dst_b", 5, 4160, 77]],
               "runs": [["a", 2, 2], ["b", 1, 1]], "copies": [[2, 0]]}


def test_fan_out_work_and_share_model_round_trip() -> None:
    assert decode(encode(Command.WORK, SHARED_WORK)).body == SHARED_WORK
    set_model = {"run_id": "r", "model_id": "m", "leader_epoch": 1, "peer_id": "s", "share_model": True}
    assert decode(encode(Command.SET_MODEL, set_model)).body["share_model"] is True


@pytest.mark.parametrize(("command", "body", "reason"), [
    (Command.WORK, {**SHARED_WORK, "runs": [["a", 2]]}, "items must be lists of 3"),
    (Command.WORK, {**SHARED_WORK, "runs": [[1, 2, 2]]}, "string"),
    (Command.WORK, {**SHARED_WORK, "copies": [[2, -1]]}, "integer"),
    (Command.SET_MODEL, {"run_id": "r", "model_id": "m", "leader_epoch": 1, "peer_id": "s", "share_model": 1},
     "true or false"),
])
def test_malformed_fan_out_fields_are_refused(command: Command, body: dict, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode([PROTOCOL_TAG, command.value, msgpack.packb(body)])


def test_worker_reads_copies_as_item_to_source() -> None:
    assert shared_sources(SHARED_WORK) == {2: 0}


@pytest.mark.parametrize(("change", "reason"), [
    ({"runs": [["a", 2, 2], ["b", 1, 2]]}, "covers 4 items"),
    ({"copies": [[2, 2]]}, "cannot copy"),
    ({"copies": [[2, 0], [0, 1]]}, "cannot copy"),  # a source that is itself a copy
    ({"copies": [[3, 0]]}, "cannot copy"),
])
def test_inconsistent_fan_out_work_is_refused_by_the_worker(change: dict, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        shared_sources({**SHARED_WORK, **change})


def test_a_copy_whose_source_cannot_be_written_is_made_in_its_own_slot() -> None:
    """Run a left (its slots 0 and 1 cannot be written): b's copies of them are made in
    b's own slots, the second copy of one source from the first, not failed."""
    sources = {2: 0, 3: 0, 4: 1, 5: 6}
    assert rehome_sources(sources, {2, 3, 4, 5, 6}, [2, 3, 4, 5]) == {3: 2, 5: 6}
    assert rehome_sources(sources, {0, 1, 2, 3, 4, 5, 6}, [2, 3, 4, 5]) == sources
