"""mode=keys: make the CurveZMQ key pairs of an authenticated pipeline, and say where each goes.

The layout is the one ``distill.pipeline.auth`` reads (see its module docstring):
every process then runs with ``pipeline.auth_keys_dir=<keys_dir>``, and each client
with ``pipeline.auth_client=<its name>``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from distill.modes.process import configure_logging
from distill.pipeline.auth import CLIENTS_DIR, KeyFiles, create_keys

log = logging.getLogger(__name__)


def run_keys(cfg: DictConfig) -> None:
    """Write the key pairs and print which file goes to which machine."""
    configure_logging(cfg)
    keys_dir = cfg.keys_dir or cfg.pipeline.auth_keys_dir
    if not keys_dir:
        raise ValueError("mode=keys needs keys_dir=<directory> (or pipeline.auth_keys_dir) to write the keys to")
    roles = {**{str(name): "student" for name in cfg.keys_students},
             **{str(name): "worker" for name in cfg.keys_workers}}
    files = create_keys(keys_dir, list(cfg.keys_clients), overwrite=cfg.keys_overwrite, roles=roles)
    print(placement(Path(keys_dir).expanduser(), files, roles), flush=True)


def placement(root: Path, files: KeyFiles, roles: dict[str, str] | None = None) -> str:
    """Which files each machine needs, relative to the keys directory (the layout is kept)."""
    def rel(path: Path) -> Path:
        return path.relative_to(root)

    lines = [f"keys written to {root} (secrets 0600, directories 0700). Copy, keeping the layout:",
             f"  broker machine:  {rel(files.server_secret)}  {rel(files.server_public)}  "
             f"{CLIENTS_DIR}/*.key  (the allow-list: delete a client's .key there to refuse it)"]
    for name, (_, secret) in files.clients.items():
        role = (roles or {}).get(name)
        lines.append(f"  client {name!r} ({f'role {role}' if role else 'any role'}):  {rel(files.server_public)}  "
                     f"{rel(secret)}  -> run it with pipeline.auth_client={name}")
    lines.append(f"every process: pipeline.auth_keys_dir=<its copy of {root}>; "
                 "never copy a .key_secret to another machine than its own")
    return "\n".join(lines)
