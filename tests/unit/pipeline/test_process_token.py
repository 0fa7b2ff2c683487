"""Process tokens: how a student tells that the worker that may write its slots is gone."""

from __future__ import annotations

import subprocess

from distill.pipeline.liveness import process_alive, process_token


def test_a_running_process_is_alive_and_an_exited_one_is_not() -> None:
    assert process_alive(process_token()) is True
    child = subprocess.Popen(["sleep", "30"])
    token = process_token(child.pid)
    assert process_alive(token) is True
    child.kill()
    child.wait()
    assert process_alive(token) is False


def test_an_unreaped_child_counts_as_dead() -> None:
    child = subprocess.Popen(["true"])
    token = process_token(child.pid)
    for _ in range(200):  # until it has exited (a zombie, not yet waited for)
        if process_alive(token) is False:
            break
        subprocess.run(["sleep", "0.01"])
    assert process_alive(token) is False
    child.wait()


def test_a_recycled_pid_is_not_the_same_process() -> None:
    scope, pid, started = process_token().rsplit(":", 2)
    assert process_alive(f"{scope}:{pid}:{int(started) + 1}") is False


def test_tokens_from_elsewhere_cannot_be_judged() -> None:
    assert process_alive(None) is None
    assert process_alive("garbage") is None
    _, pid, started = process_token().rsplit(":", 2)
    assert process_alive(f"another-boot/pid:[1]:{pid}:{started}") is None
