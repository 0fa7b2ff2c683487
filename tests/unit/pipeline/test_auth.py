"""Access control without a network: the private ipc directory, key files and their
permissions, and the allow-list the broker's ZAP handler consults."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq

from distill.pipeline import Broker
from distill.pipeline.auth import (
    AllowList,
    AuthError,
    CurveConfig,
    check_allow_list,
    create_keys,
    read_public_file,
    read_secret_file,
)
from distill.pipeline.endpoints import prepare_endpoint

pytestmark = pytest.mark.timeout(60)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_ipc_socket_directory_is_created_private(tmp_path: Path) -> None:
    directory = tmp_path / "a" / "sock"
    prepare_endpoint(f"ipc://{directory}/frontend.sock")
    assert _mode(directory) == 0o700


@pytest.mark.parametrize("mode", [0o711, 0o750, 0o755, 0o701])
def test_ipc_socket_directory_others_could_enter_is_refused(tmp_path: Path, mode: int) -> None:
    directory = tmp_path / "open"
    directory.mkdir()
    directory.chmod(mode)
    with pytest.raises(PermissionError, match=f"chmod 700 {directory}"):
        prepare_endpoint(f"ipc://{directory}/frontend.sock")


def test_broker_refuses_to_bind_in_an_open_directory(tmp_path: Path) -> None:
    directory = tmp_path / "open"
    directory.mkdir()
    directory.chmod(0o755)
    endpoints = {f"{name}_endpoint": f"ipc://{directory}/{name}.sock"
                 for name in ("frontend", "backend", "control", "control_pub")}
    with pytest.raises(PermissionError, match="open to other users"):
        Broker(**endpoints).start()
    assert not list(directory.iterdir())  # nothing bound there


def test_create_keys_writes_private_secrets_and_public_keys(tmp_path: Path) -> None:
    root = tmp_path / "keys"
    files = create_keys(root, ["w0", "student"])
    assert _mode(root) == 0o700 and _mode(root / "clients") == 0o700
    assert _mode(files.server_secret) == 0o600
    assert {name: _mode(secret) for name, (_, secret) in files.clients.items()} == {"w0": 0o600,
                                                                                  "student": 0o600}
    public, secret = read_secret_file(files.server_secret)
    assert read_public_file(files.server_public) == public and len(secret) == 40
    assert zmq.curve_public(secret) == public  # a real key pair
    keys = CurveConfig.from_keys_dir(root, "w0").client_keys()
    assert keys.server_public == public and keys.public == read_public_file(files.clients["w0"][0])


def test_create_keys_keeps_existing_keys_unless_told(tmp_path: Path) -> None:
    files = create_keys(tmp_path, ["a"])
    before = read_secret_file(files.server_secret)
    with pytest.raises(AuthError, match="keys_overwrite=true"):
        create_keys(tmp_path, ["a"])
    assert read_secret_file(files.server_secret) == before
    create_keys(tmp_path, ["a"], overwrite=True)
    assert read_secret_file(files.server_secret) != before


@pytest.mark.parametrize("names", [[], ["server"], ["a/b"], ["a", "a"], [".hidden"]])
def test_create_keys_refuses_unusable_client_names(tmp_path: Path, names: list[str]) -> None:
    with pytest.raises(AuthError, match="keys_clients"):
        create_keys(tmp_path, names)
    assert not (tmp_path / "server.key").exists()


def test_a_secret_others_can_read_is_refused(tmp_path: Path) -> None:
    files = create_keys(tmp_path, ["a"])
    files.clients["a"][1].chmod(0o640)
    with pytest.raises(AuthError, match="chmod 600"):
        CurveConfig.from_keys_dir(tmp_path, "a").client_keys()
    files.server_secret.chmod(0o604)
    with pytest.raises(AuthError, match="chmod 600"):
        Broker(curve=CurveConfig.from_keys_dir(tmp_path))


def test_missing_or_wrong_key_files_name_the_file(tmp_path: Path) -> None:
    files = create_keys(tmp_path, ["a"])
    with pytest.raises(AuthError, match=r"nobody\.key_secret does not exist.*mode=keys"):
        CurveConfig.from_keys_dir(tmp_path, "nobody").client_keys()
    wrong = CurveConfig(server_public_file=files.server_public, client_secret_file=files.clients["a"][0])
    with pytest.raises(AuthError, match="holds no secret key"):
        wrong.client_keys()
    garbage = tmp_path / "garbage.key_secret"
    garbage.write_text("hello\n")
    garbage.chmod(0o600)
    with pytest.raises(AuthError, match="not a ZeroMQ certificate"):
        read_secret_file(garbage)
    with pytest.raises(AuthError, match="needs server_secret_file"):
        CurveConfig(server_public_file=files.server_public).server_keys()


def test_allow_list_others_can_write_is_refused(tmp_path: Path) -> None:
    create_keys(tmp_path, ["a"])
    (tmp_path / "clients").chmod(0o777)
    with pytest.raises(AuthError, match="chmod 700"):
        check_allow_list(tmp_path / "clients")
    with pytest.raises(AuthError, match="does not exist"):
        check_allow_list(tmp_path / "nowhere")


def test_allow_list_admits_listed_keys_and_follows_deletions(tmp_path: Path) -> None:
    files = create_keys(tmp_path, ["a", "b"])
    allow = AllowList(tmp_path / "clients")
    key_a, key_b = (read_public_file(files.clients[n][0]) for n in ("a", "b"))
    stranger = zmq.curve_keypair()[0]
    assert allow.callback("distill", key_a) and allow.callback("distill", key_b)
    assert not allow.callback("distill", stranger)
    os.unlink(files.clients["b"][0])  # revoke b: its next connection is refused
    os.utime(tmp_path / "clients", ns=(0, 1))  # a coarse clock could leave the mtime unchanged
    assert allow.callback("distill", key_a) and not allow.callback("distill", key_b)
    assert allow.refused == 2
