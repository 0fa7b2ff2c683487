"""The wire protocol: round trips, and refusal of anything malformed."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from distill.pipeline.notices import (
    LANE_COMMANDS,
    decode_datagram,
    decode_notice,
    encode_datagram,
    encode_notice,
)
from distill.pipeline.protocol import (
    PROTOCOL_TAG,
    SCHEMA,
    Command,
    ProtocolError,
    decode,
    encode,
    send_patiently,
)

VALID = {
    Command.REQUEST: {"run_id": "r", "peer_id": "p", "generation": 3, "medium": "dst_a_1_0",
                      "stride": 4160, "slots": [[0, 1], [1, 2]]},
    Command.WORK: {"work_id": 1, "run_id": "r", "generation": 1, "model_id": "m", "model_cfg": {"a": 1},
                   "items": [["dst_a_1_0", 0, 4160, 9]]},
    Command.DONE: {"peer_id": "w", "work_id": 1, "num_items": 1, "failed": [[0, "boom"]],
                   "notified": ["dst_a_1_0"]},
    Command.COMPLETE: {"generation": 1, "slots": [[0, 1, True]]},
    Command.SET_MODEL: {"run_id": "r", "model_id": "layer_0", "leader_epoch": 7, "peer_id": "student-1",
                        "leader_secret": "0123456789abcdef"},
    Command.QUARANTINE: {"slots": [], "process": "boot/pid:[1]:42:99", "direct": True},
    Command.RELEASE: {"slots": [[3, 11]]},
    Command.DIRECT: {"run_id": "r", "peer_id": "p", "generation": 3, "medium": "dst_a_1_0",
                     "stride": 4160, "slots": [[0, 1]]},
    Command.DECLINED: {"generation": 3, "slots": [[0, 1]], "reason": "another generation"},
    Command.HEARTBEAT: {"peer_id": "w", "role": "worker", "direct": {"r": [10, 1]}, "interval_ms": 200},
}


@pytest.mark.parametrize("command", list(VALID))
def test_round_trip(command: Command) -> None:
    msg = decode(encode(command, VALID[command]))
    assert msg.command is command
    assert msg.body == VALID[command]


def test_every_command_has_a_schema() -> None:
    assert set(SCHEMA) == set(Command)


@pytest.mark.parametrize(("frames", "reason"), [
    ([PROTOCOL_TAG, b"REQUEST"], "3 frames"),
    ([b"XXX\x01", b"REQUEST", msgpack.packb({})], "protocol tag"),
    ([PROTOCOL_TAG, b"NOPE", msgpack.packb({})], "unknown command"),
    ([PROTOCOL_TAG, b"REQUEST", b"\xc1\xc1"], "not msgpack"),
    ([PROTOCOL_TAG, b"REQUEST", msgpack.packb([1, 2])], "must be a map"),
    ([PROTOCOL_TAG, b"SET_MODEL", msgpack.packb({"run_id": "r"})], "missing field"),
    ([PROTOCOL_TAG, b"SET_MODEL", msgpack.packb({"run_id": "r", "model_id": "m", "x": 1})], "unknown field"),
    ([PROTOCOL_TAG, b"REQUEST", msgpack.packb({**VALID[Command.REQUEST], "stride": -1})], "integer"),
    ([PROTOCOL_TAG, b"REQUEST", msgpack.packb({**VALID[Command.REQUEST], "stride": 2**64 - 1})], "integer"),
    ([PROTOCOL_TAG, b"REQUEST", msgpack.packb({**VALID[Command.REQUEST], "slots": [[1]]})], "items"),
    ([PROTOCOL_TAG, b"REQUEST", msgpack.packb({**VALID[Command.REQUEST], "slots": [["a", 1]]})], "integer"),
    ([PROTOCOL_TAG, b"REQUEST", msgpack.packb({**VALID[Command.REQUEST], "medium": "x" * 300})], "string"),
    ([PROTOCOL_TAG, b"COMPLETE", msgpack.packb({"generation": 1, "slots": [[0, 1, 1]]})], "bool"),
    ([PROTOCOL_TAG, b"DONE", msgpack.packb({**VALID[Command.DONE], "notified": "dst_a_1_0"})], "strings"),
    ([PROTOCOL_TAG, b"DONE", msgpack.packb({**VALID[Command.DONE], "notified": [1]})], "strings"),
    ([PROTOCOL_TAG, b"DONE", msgpack.packb({**VALID[Command.DONE], "notified": ["x" * 300]})], "strings"),
])
def test_malformed_messages_raise_protocol_error(frames: list[bytes], reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode(frames)


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=5))
def test_random_frames_never_crash_the_decoder(frames: list[bytes]) -> None:
    with contextlib.suppress(ProtocolError):
        decode(frames)


plain = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=8) | st.binary(max_size=8),
                     lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
                     max_leaves=12)


@settings(max_examples=1000, deadline=None)
@given(st.sampled_from(list(Command)), st.dictionaries(st.sampled_from(["run_id", "peer_id", "generation", "slots", "items", "stride", "medium", "x"]), plain, max_size=6))
def test_random_bodies_are_accepted_only_when_valid(command: Command, body: dict) -> None:
    frames = [PROTOCOL_TAG, command.value, msgpack.packb(body, use_bin_type=True)]
    try:
        msg = decode(frames)
    except ProtocolError:
        return
    assert encode(msg.command, msg.body)  # anything accepted also passes our own encoder


def test_a_notice_is_one_datagram_holding_a_complete() -> None:
    msg = decode_notice(encode_notice(4, [[0, 9, True], [3, 10, True]]))
    assert msg.command is Command.COMPLETE
    assert msg.body == {"generation": 4, "slots": [[0, 9, True], [3, 10, True]]}
    lane = decode_notice(encode_notice(4, [[0, 9, True]], "/run/x/worker-1-ab.lane", "boot/pid:[1]:7:9"))
    assert lane.body["lane"] == "/run/x/worker-1-ab.lane" and lane.body["process"] == "boot/pid:[1]:7:9"


def test_an_inbox_takes_declines_and_a_lane_takes_only_direct_requests() -> None:
    declined = encode_datagram(Command.DECLINED, VALID[Command.DECLINED])
    direct = encode_datagram(Command.DIRECT, VALID[Command.DIRECT])
    assert decode_notice(declined).body["reason"] == "another generation"
    assert decode_datagram(direct, LANE_COMMANDS).body == VALID[Command.DIRECT]
    with pytest.raises(ProtocolError, match="not accepted here"):
        decode_notice(direct)  # a student's inbox is not a lane
    with pytest.raises(ProtocolError, match="not accepted here"):
        decode_datagram(declined, LANE_COMMANDS)


@pytest.mark.parametrize(("datagram", "reason"), [
    (b"\xc1", "not msgpack"),
    (msgpack.packb({"a": 1}), "list of frames"),
    (msgpack.packb([1, 2, 3]), "list of frames"),
    (msgpack.packb([PROTOCOL_TAG, b"COMPLETE"]), "3 frames"),
    (msgpack.packb(encode(Command.RELEASE, {"slots": [[1, 2]]})), "not accepted here"),
    (msgpack.packb([PROTOCOL_TAG, b"COMPLETE", msgpack.packb({"generation": 1, "slots": [[0, -1, True]]})]),
     "integer"),
])
def test_bad_notices_raise_protocol_error(datagram: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode_notice(datagram)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=128))
def test_random_datagrams_never_crash_the_notice_decoder(datagram: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode_notice(datagram)


@pytest.fixture
def dealer():
    """A DEALER with a send timeout and, so far, no route anywhere (nothing connected)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDTIMEO, 10)
    sock.setsockopt(zmq.LINGER, 0)
    yield sock
    sock.close()


def test_send_patiently_asks_whether_to_go_on_while_there_is_no_route(dealer) -> None:
    asked = []

    def three_times() -> bool:
        asked.append(1)
        return len(asked) < 3

    def refused() -> bool:
        raise PermissionError("refused")

    assert not send_patiently(dealer, Command.RELEASE, VALID[Command.RELEASE], three_times)
    assert len(asked) == 3  # asked after each timeout, given up when told to
    with pytest.raises(PermissionError, match="refused"):
        send_patiently(dealer, Command.RELEASE, VALID[Command.RELEASE], refused)


def test_send_patiently_sends_the_whole_message_once_a_route_appears(dealer) -> None:
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    asked = []

    def connect_on_second_ask() -> bool:
        asked.append(1)
        if len(asked) == 2:
            dealer.connect(f"tcp://127.0.0.1:{port}")
        return True

    try:
        assert send_patiently(dealer, Command.RELEASE, VALID[Command.RELEASE], connect_on_second_ask)
        assert router.poll(5000)
        _identity, *frames = router.recv_multipart()
        assert decode(frames).body == VALID[Command.RELEASE] and len(asked) == 2
    finally:
        router.close()
