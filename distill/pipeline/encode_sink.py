"""Where ``BatchConfig.encode`` writes while a worker's ``generator_fn`` runs.

While the worker calls ``generator_fn`` for one slot, that slot's payload is *open*
here, and the first ``encode`` of a sample of at least ``ENCODE_INTO_MIN_BYTES`` that
fits writes the sample's bytes straight into it (the same bytes, converted as
``encode`` converts) and returns a read-only ``memoryview`` of them instead of new
``bytes``; the worker sees that very view come back and has nothing left to copy.

The view is bytes-like (``len``, slicing, ``bytes(...)``, comparison, hashing) but it
*is* the slot: it is released when the generator returns, so keeping it for
a later call fails loudly (the worker fails that slot saying so) instead of handing
out a slot the student has since reused. Later ``encode`` calls of the same call,
smaller samples, other threads and code outside a worker get ``bytes`` as before. See
docs/pipeline.md, section The Python API; figures in docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import threading

ENCODE_INTO_MIN_BYTES = 64 << 10
"""Samples of at least this many bytes are encoded into the open slot. Below it the bytes
cost less than the views the slot write needs (the same threshold as the student's loans,
``loans.LEND_MIN_BYTES``), and ``encode`` keeps returning plain ``bytes``."""


class _Sink(threading.local):
    payload: memoryview | None = None
    """The open slot's payload (None: no worker is calling a generator on this thread)."""
    written: memoryview | None = None
    """What ``encode`` wrote into it and returned."""


_sink = _Sink()


def open_slot(payload: memoryview) -> None:
    """A worker is about to call ``generator_fn`` for the slot whose payload this is."""
    _sink.payload, _sink.written = payload, None


def take_slot(nbytes: int) -> memoryview | None:
    """The open payload for an ``encode`` of ``nbytes`` bytes, taken (only the first
    ``encode`` of a call writes into the slot), or None: encode into new bytes."""
    payload = _sink.payload
    if payload is None or nbytes < ENCODE_INTO_MIN_BYTES or len(payload) < nbytes:
        return None
    _sink.payload = None
    return payload


def note_written(view: memoryview) -> None:
    """``encode`` wrote the sample into the taken payload and returns ``view`` of it."""
    _sink.written = view


def close_slot(returned: object) -> int:
    """The generator returned ``returned``: the bytes it already put in the slot (the view
    ``encode`` handed out, returned as it was), or 0 (the worker copies ``returned`` in).
    The handed-out view ends here, so a generator that kept it cannot use it on a later
    call (a view the caller exported further, e.g. into numpy, stays: that is theirs)."""
    written = _sink.written
    _sink.payload, _sink.written = None, None
    if written is None:
        return 0
    in_slot = written.nbytes if returned is written else 0
    with contextlib.suppress(BufferError):
        written.release()
    return in_slot
