"""The model configs a worker was sent, by digest.

A run's ``model_cfg`` may weigh up to ``protocol.MAX_CFG_BYTES``. The broker sends it in
a worker's first WORK of the model and only its digest after that
(``broker/dispatch.cfg_fields``); this cache gives each later WORK its config back. A
WORK whose digest is not here (evicted, or the WORK that carried it was lost) is not
filled: the worker answers it "stale" with ``unknown_cfg``, the broker sends the config
with the next WORK, and the students ask for those slots again. Filling it with no
config, or another model's, would be a wrong sample that looks right.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

MAX_CONFIGS = 64
"""Configs kept (the least recently used go first): at most 64 x MAX_CFG_BYTES packed."""


class ModelConfigs:
    """Digest -> model_cfg, least recently used first."""

    def __init__(self, max_configs: int | None = None) -> None:
        self.max_configs = MAX_CONFIGS if max_configs is None else max_configs
        self._cfgs: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def resolve(self, body: dict[str, Any]) -> bool:
        """Give a WORK body its ``model_cfg`` (kept when it carries one, looked up when it
        carries only the digest). False: the digest is unknown here."""
        digest = body.get("model_digest")
        if digest is None:  # a model without a config
            return True
        cfg = body.get("model_cfg")
        if cfg is None:
            cfg = self._cfgs.get(digest)
            if cfg is None:
                return False
            body["model_cfg"] = cfg
        self._cfgs[digest] = cfg
        self._cfgs.move_to_end(digest)
        while len(self._cfgs) > self.max_configs:
            self._cfgs.popitem(last=False)
        return True
