"""Random and mutated protocol messages for fuzz tests, reproducible from a seed.

Most of what a fuzzer sends at random is refused by the first check (frame count,
tag); the interesting inputs are *almost* valid. So every message starts as a real,
valid message of some command (with addresses aimed at real segments when the test
has them) and is then mutated at the body level (missing or unknown fields, values
of the wrong type, huge or negative integers, long strings, unknown or foreign
segment names, slots and strides outside the segment) and/or at the frame level
(frames dropped, added, duplicated or swapped, bytes flipped, truncated bodies,
wrong version tag, unknown commands). About one message in eight is left valid,
so state-changing paths (REQUEST, READY, DONE, WORK, SET_MODEL) run too.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from distill.pipeline.protocol import MAX_STRING_CHARS, PROTOCOL_TAG, PROTOCOL_VERSION, Command

# Integers msgpack can encode, chosen at the edges our code compares against.
EDGE_INTS = [0, 1, 2, 7, 63, 64, 65, 255, 4096, 65535, 65536, 2**31 - 1, 2**31, 2**32, 2**53,
             2**62, 2**63 - 2, 2**63 - 1, 2**63, 2**64 - 1, -1, -2, -(2**31), -(2**63)]
WRONG_TYPES: list[Any] = [None, True, False, 1.5, float("nan"), "s", b"bytes", [], {}, [1, [2]],
                          {"a": {"b": 1}}, [[0, 1, 2, 3, 4]], -1]
FOREIGN_NAMES = ["psm_12345", "wnsm_abc", "../../etc/passwd", "/dev/shm/dst_a_1_1", "dst_a_1_1/../x",
                 "dst_" + "a" * 300, "", "dst_nobody_1_1", "dst_a-b_1_1", "dst_a_1", "\x00dst_a_1_1",
                 "dst_ä_1_1", "DST_a_1_1"]
UNKNOWN_COMMANDS = [b"", b"FROBNICATE", b"hello", b"REQUES", b"REQUESTX", b"\x00" * 8, b"\xff" * 64,
                    b"STATS\x00", b"ERROR " * 10]


@dataclass
class Targets:
    """What the fuzzed peer knows about: names and geometry worth aiming at."""

    mediums: list[str] = field(default_factory=list)
    """Real segments of ours (a fuzzed worker may map them)."""
    foreign_mediums: list[str] = field(default_factory=list)
    """Real segments the peer must never map (foreign name, or not private)."""
    stride: int = 4160
    slot_count: int = 4
    run_ids: list[str] = field(default_factory=lambda: ["default", "fuzz", "r" * MAX_STRING_CHARS])
    peer_ids: list[str] = field(default_factory=lambda: [f"fuzz-peer-{i}" for i in range(8)])
    max_items: int = 8


class Mutator:
    """Makes messages (lists of frames) from a seeded ``random.Random``."""

    def __init__(self, seed: int, targets: Targets, commands: list[Command] | None = None) -> None:
        self.rng = random.Random(seed)
        self.targets = targets
        self.commands = commands or list(Command)

    # ------------------------------------------------------------------ messages
    def message(self) -> list[bytes]:
        """One message: valid, body-mutated, frame-mutated, or both."""
        rng = self.rng
        command = rng.choice(self.commands) if rng.random() < 0.8 else rng.choice(list(Command))
        body: Any = self.valid_body(command)
        roll = rng.random()
        if roll < 0.125:
            return self.frames(command, body)
        if roll < 0.7:
            for _ in range(rng.randint(1, 3)):
                body = self.mutate_body(body)
        frames = self.frames(command, body)
        if roll >= 0.55:
            for _ in range(rng.randint(1, 2)):
                frames = self.mutate_frames(frames)
        return frames

    @staticmethod
    def frames(command: Command, body: Any) -> list[bytes]:
        return [PROTOCOL_TAG, command.value, msgpack.packb(body, use_bin_type=True)]

    # ------------------------------------------------------------------ valid bodies
    def valid_body(self, command: Command) -> dict[str, Any]:
        return self._BODIES[command](self)

    def _int(self) -> int:
        return self.rng.choice([0, 1, 2, 3, 17, 1000, 2**40])

    def _run(self) -> str:
        return self.rng.choice(self.targets.run_ids)

    def _peer(self) -> str:
        return self.rng.choice(self.targets.peer_ids)

    def _medium(self) -> str:
        t, rng = self.targets, self.rng
        pool = t.mediums if t.mediums and rng.random() < 0.6 else (t.foreign_mediums + FOREIGN_NAMES)
        return rng.choice(pool or FOREIGN_NAMES)

    def _slot_idx(self) -> int:
        t, rng = self.targets, self.rng
        return rng.choice([0, 1, t.slot_count - 1, t.slot_count, t.slot_count + 1, 2**31, 2**63 - 1,
                           rng.randrange(t.slot_count)])

    def _stride(self) -> int:
        t, rng = self.targets, self.rng
        return rng.choice([t.stride, t.stride, t.stride * 2, t.stride + 64, t.stride - 64, 64, 65, 0, 1,
                           t.stride * t.slot_count, 2**62, 2**63 - 1])

    def _slots(self) -> list[list[int]]:
        return [[self._slot_idx(), self._int()] for _ in range(self.rng.randint(0, self.targets.max_items))]

    def _items(self) -> list[list]:
        return [[self._medium(), self._slot_idx(), self._stride(), self._int()]
                for _ in range(self.rng.randint(0, self.targets.max_items))]

    def _model_cfg(self) -> dict | None:
        return self.rng.choice([None, {}, {"delay_s": 0.0}, {"a": [1, 2, {"b": None}]}])

    _BODIES: dict[Command, Callable[[Mutator], dict[str, Any]]] = {
        Command.HELLO: lambda m: {"run_id": m._run(), "peer_id": m._peer(), "rank": m._int()},
        Command.WELCOME: lambda m: {"run_id": m._run(), "generation": m._int(), "model_id": "m",
                                    "model_cfg": m._model_cfg(), "heartbeat_interval_ms": 200},
        Command.REQUEST: lambda m: {"run_id": m._run(), "peer_id": m._peer(), "generation": m._int(),
                                    "medium": m._medium(), "stride": m._stride(), "slots": m._slots()},
        Command.READY: lambda m: {"peer_id": m._peer(), "credit": m.rng.choice([0, 1, 16, 2**40]),
                                  "max_batch": m.rng.choice([0, 1, 8, 2**40]), **m._direct_report()},
        Command.WORK: lambda m: {"work_id": m._int(), "run_id": m._run(), "generation": m._int(),
                                 "model_id": "m", "model_cfg": m._model_cfg(), "items": m._items()},
        Command.DONE: lambda m: {"peer_id": m._peer(), "work_id": m._int(), "num_items": m._int(),
                                 "failed": [[m._int(), "x"] for _ in range(m.rng.randint(0, 3))]},
        Command.COMPLETE: lambda m: {"generation": m._int(),
                                     "slots": [[i, r, m.rng.random() < 0.5] for i, r in m._slots()]},
        Command.DISCARDED: lambda m: {"generation": m._int(), "slots": m._slots()},
        Command.SET_MODEL: lambda m: {"run_id": m._run(), "model_id": "m", "model_cfg": m._model_cfg(),
                                      "restore_generation": m.rng.choice([None, 0, 5, 2**63 - 2, 2**63 - 1]),
                                      "leader_epoch": m._int(), "peer_id": m._peer()},
        Command.QUARANTINE: lambda m: {"slots": m._slots(), "process": m.rng.choice([None, "x", "a/b:1:2"]),
                                       "direct": m.rng.choice([None, False, True])},
        Command.RELEASE: lambda m: {"slots": m._slots()},
        Command.DATA: lambda m: {"generation": m._int(), "stride": m._stride(), "slots": m._slots()},
        Command.MODEL_SET: lambda m: {"run_id": m._run(), "generation": m._int(), "model_id": "m"},
        Command.MODEL: lambda m: {"run_id": m._run(), "generation": m._int(), "model_id": "m",
                                  "model_cfg": m._model_cfg()},
        Command.STOP: lambda m: {"run_id": m._run()},
        Command.STATS: lambda m: {"run_id": m.rng.choice([None, m._run()])},
        Command.STATS_REPLY: lambda m: {"stats": {"queued": 1}},
        Command.HEARTBEAT: lambda m: {"peer_id": m._peer(), "role": m.rng.choice(["worker", "student", "x"]),
                                      **m._direct_report()},
        Command.RECONNECT: lambda m: {},
        Command.BYE: lambda m: {"peer_id": m._peer()},
        Command.ERROR: lambda m: {"reason": "fuzz", "command": "WORK"},
        Command.DIRECT: lambda m: {"run_id": m._run(), "peer_id": m._peer(), "generation": m._int(),
                                   "medium": m._medium(), "stride": m._stride(), "slots": m._slots()},
        Command.DECLINED: lambda m: {"generation": m._int(), "slots": m._slots(), "reason": "fuzz"},
    }

    def _direct_report(self) -> dict[str, Any]:
        """A worker's DIRECT fill counts (READY, HEARTBEAT): absent, sane or odd."""
        return self.rng.choice([{}, {"direct": {self._run(): [self._int(), self._int()]}},
                                {"direct": {"default": [2**63 - 1, 0], "x": [1]}},
                                {"direct": {"default": ["a", None], "y": {"z": 1}}}, {"direct": {}}])

    # ------------------------------------------------------------------ mutations
    def mutate_body(self, body: Any) -> Any:
        rng = self.rng
        if not isinstance(body, dict) or rng.random() < 0.05:
            return rng.choice([[1, 2], 7, "body", None, b"\x00" * 16, [body], 2**64 - 1])
        body = dict(body)
        keys = list(body)
        op = rng.randrange(7)
        if op == 0 and keys:
            del body[rng.choice(keys)]
        elif op == 1:
            body[rng.choice(["x", "", "slots", "items", "k" * 300, "generation2"])] = rng.choice(WRONG_TYPES)
        elif op == 2 and keys:
            body[rng.choice(keys)] = rng.choice(WRONG_TYPES)
        elif op == 3 and keys:
            body[rng.choice(keys)] = rng.choice(EDGE_INTS)
        elif op == 4 and keys:
            body[rng.choice(keys)] = rng.choice(["", "x" * MAX_STRING_CHARS, "x" * (MAX_STRING_CHARS + 1),
                                                 "x" * 10_000, "\ufffd\u0000é", *FOREIGN_NAMES])
        elif op == 5:
            lists = [k for k in keys if isinstance(body[k], list)]
            if lists:
                key = rng.choice(lists)
                body[key] = self._mutate_list(body[key])
        elif op == 6:
            for key in ("slots", "items", "failed"):
                if isinstance(body.get(key), list) and len(body[key]) <= 100:  # at most ~8,000 items
                    body[key] = body[key] * rng.choice([0, 2, 10, 100])
        return body

    def _mutate_list(self, items: list) -> list:
        rng = self.rng
        items = [list(i) if isinstance(i, list) else i for i in items] or [[0, 1]]
        i = rng.randrange(len(items))
        item = items[i]
        choice = rng.randrange(5)
        if choice == 0 and isinstance(item, list) and item:
            item[rng.randrange(len(item))] = rng.choice(EDGE_INTS + WRONG_TYPES)
        elif choice == 1 and isinstance(item, list):
            item.append(rng.choice(EDGE_INTS))
        elif choice == 2 and isinstance(item, list) and item:
            item.pop()
        elif choice == 3:
            items[i] = rng.choice(WRONG_TYPES)
        else:
            items.insert(i, rng.choice(WRONG_TYPES + EDGE_INTS))
        return items

    def mutate_frames(self, frames: list[bytes]) -> list[bytes]:
        rng = self.rng
        frames = list(frames)
        op = rng.randrange(10)
        i = rng.randrange(len(frames)) if frames else 0
        if op == 0 and frames:
            del frames[i]
        elif op == 1:
            frames.insert(rng.randrange(len(frames) + 1), rng.randbytes(rng.choice([0, 1, 8, 100])))
        elif op == 2 and frames:
            frames.insert(i, frames[i])
        elif op == 3 and len(frames) > 1:
            j = rng.randrange(len(frames))
            frames[i], frames[j] = frames[j], frames[i]
        elif op == 4 and frames and frames[-1]:
            frames[-1] = frames[-1][:rng.randrange(len(frames[-1]))]
        elif op == 5 and frames and frames[-1]:
            raw = bytearray(frames[-1])
            for _ in range(rng.randint(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            frames[-1] = bytes(raw)
        elif op == 6 and frames:
            frames[0] = b"DST" + bytes([rng.choice([0, PROTOCOL_VERSION + 1, 255])])
        elif op == 7 and len(frames) > 1:
            frames[1] = rng.choice(UNKNOWN_COMMANDS)
        elif op == 8 and frames:
            frames[-1] = frames[-1] + rng.randbytes(rng.choice([1, 16, 65536]))
        elif frames:
            frames[-1] = rng.choice([b"", b"\xc1", b"\x91", b"\xdf\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
                                     b"\xc6\xff\xff\xff\xff", msgpack.packb([1] * 100)])
        return frames
