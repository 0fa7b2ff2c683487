"""Samples lent as views of their slots: no copy, and the slot comes back to its pool
when the last tensor over it is gone.

A lent sample's tensors are views of the slot's payload through a storage of their
own (an ndarray over the slot, ``torch.frombuffer``), so the loan ends exactly when
the consumer has let go of every tensor over it, whichever thread lets go (a
DataLoader worker that pickles a sample moves it into shared memory, which lets go
too); the pool then asks for the slot again. At most ``limit`` slots (half the pool)
are out on loan; past that samples are copied, so a consumer that keeps samples never
stalls the workers. Why lend: docs/pipeline.md, section The Python API.
"""

from __future__ import annotations

import collections
import weakref

import numpy as np
import torch

from distill.pipeline.batch import BatchConfig

LEND_MIN_BYTES = 64 << 10
"""Samples of at least this many bytes are lent; smaller ones are copied, a whole chunk of
ready slots with one ``index_select`` per tensor: below this, a copy costs less than a loan's
own bookkeeping (an ndarray, a storage and a finalizer, about 8 us)."""


class SlotLoans:
    """Lends slots' payloads as tensors and collects the slots whose loans ended."""

    def __init__(self, config: BatchConfig, limit: int) -> None:
        self._layout = [(spec.name, config.offset_of(spec.name), spec.nbytes, spec.torch_dtype, spec.shape)
                        for spec in config.specs]
        self._plans: dict[int, list[tuple]] = {}
        """slot -> how each tensor is made over its payload (worked out on the slot's first loan)."""
        self._lent: dict[int, tuple[int, weakref.ref]] = {}
        """id(weak reference to a loan's ndarray) -> (slot, the reference): kept alive, so its
        callback runs when the loan's last tensor is gone."""
        self.limit = limit
        """At most this many slots out on loan at once (past it, :meth:`room` says no)."""
        self.out = 0
        """Slots lent and not yet back."""
        self._back: collections.deque[int] = collections.deque()
        """Slots whose last tensor is gone (appended by weakref callbacks, from any thread)."""

    def room(self) -> bool:
        """Whether one more slot may be lent."""
        return self.out < self.limit

    def lend(self, slot: int, payload: memoryview) -> dict[str, torch.Tensor]:
        """The sample in ``payload`` (slot ``slot``'s) as tensors over it; the slot comes
        back (:meth:`returned`) when the last of them, and of views made of them, is gone.

        Per loan: one ndarray (the loan's owner, whose death ends it), one weak reference
        with a callback, and per tensor one ``torch.frombuffer`` in its own dtype, viewed to
        its shape only when that has more than one dimension (a loan of one 256 KiB tensor:
        about 3 us here, against 7 us with a ``weakref.finalize`` and two views per tensor)."""
        owner = np.frombuffer(payload, dtype=np.uint8)
        ref = weakref.ref(owner, self._ended)
        self._lent[id(ref)] = (slot, ref)
        self.out += 1
        plan = self._plans.get(slot)
        if plan is None:
            plan = self._plans[slot] = self._plan(owner.ctypes.data)
        return {name: make(owner) for name, make in plan}

    def _plan(self, address: int) -> list[tuple]:
        """How to make each tensor over a payload at ``address``: straight in its dtype where
        its bytes are aligned to it, else as bytes viewed to the dtype (tensors are packed
        back to back, so a later tensor's offset need not be a multiple of its item size)."""
        plan = []
        for name, offset, nbytes, dtype, shape in self._layout:
            if not nbytes:
                plan.append((name, lambda _owner, shape=shape, dtype=dtype: torch.empty(shape, dtype=dtype)))
            elif (address + offset) % dtype.itemsize == 0:
                plan.append((name, _typed(offset, nbytes // dtype.itemsize, dtype, shape)))
            else:
                plan.append((name, lambda owner, offset=offset, nbytes=nbytes, dtype=dtype, shape=shape:
                             torch.frombuffer(owner, dtype=torch.uint8, count=nbytes,
                                              offset=offset).view(dtype).view(shape)))
        return plan

    def _ended(self, ref: weakref.ref) -> None:
        """A loan's ndarray is gone: its slot comes back (runs in whichever thread let go)."""
        slot, _ = self._lent.pop(id(ref))
        self._back.append(slot)

    def waiting(self) -> int:
        """Slots whose loans ended and that :meth:`returned` has not handed back yet."""
        return len(self._back)

    def returned(self) -> list[int]:
        """The slots whose loans ended since the last call (each once)."""
        back = []
        while self._back:
            back.append(self._back.popleft())  # deque pops are atomic: finalizers may append meanwhile
        self.out -= len(back)
        return back



def _typed(offset: int, numel: int, dtype: torch.dtype, shape: tuple[int, ...]):
    """Makes a tensor of ``dtype`` and ``shape`` over an aligned payload's bytes at ``offset``."""
    if len(shape) == 1:
        return lambda owner: torch.frombuffer(owner, dtype=dtype, count=numel, offset=offset)
    return lambda owner: torch.frombuffer(owner, dtype=dtype, count=numel, offset=offset).view(shape)
