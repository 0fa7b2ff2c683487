"""End to end through the CLI: mode=local starts a broker, 2 teacher workers and 2 gloo DDP
ranks as real processes; resume after kill -9; export, reload, evaluate; clean teardown."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distill.errors import INTERRUPTED, INTERRUPTED_EXIT_CODE
from distill.model.continuations import PROMPTS

RUN_TIMEOUT_S = 300
ROOT = Path(__file__).resolve().parents[2]


def _tiny(tmp_path: Path, layers: int = 3) -> list[str]:
    return [
        f"teacher.tiny.num_layers={layers}", "teacher.tiny.hidden_size=32", "teacher.tiny.num_heads=2",
        "teacher.tiny.vocab_size=300", "teacher.tiny.train_steps=30", f"teacher.cache_dir={shared_tiny_cache(tmp_path)}",
        "data.seq_len=32", "data.max_heldout_chunks=8", "student.micro_batch_size=4",
        "student.log_every_steps=2", "pipeline.slot_count=8", "pipeline.heartbeat_interval_s=0.5",
        "local.num_workers=2", "local.num_students=2", "log_level=INFO",
        "student.e2e.steps=0",  # tests that need the end-to-end stage turn it on
    ]


def shared_tiny_cache(tmp_path: Path) -> Path:
    """The test session's tiny-teacher cache, beside every test's own tmp_path (above the
    pytest-xdist workers' own directories, which share it): each tiny shape is built once per
    session (5-9 s each; the cache's own lock serialises the first build) instead of once per test."""
    return (tmp_path.parent.parent if os.environ.get("PYTEST_XDIST_WORKER") else tmp_path.parent) / "tiny-cache"


def _cmd(overrides: list[str], run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "distill", "mode=local", *overrides, f"hydra.run.dir={run_dir}"]


def _run(overrides: list[str], run_dir: Path, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(_cmd(overrides, run_dir), cwd=cwd, capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S, env=_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _procs_with(marker: str) -> list[int]:
    """Pids whose command line mentions ``marker`` (our run id)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


def _run_id(name: str) -> str:
    """A run id that no test of another pytest session on this machine uses at the same time
    (the suite may run twice side by side): these tests find their run's processes by it, to
    kill one or to check that none is left."""
    return f"{name}{os.getpid()}"


def _wait_gone(marker: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while (left := _procs_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"orphan processes of {marker}: {left}"


def _wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"run ended (code {proc.returncode}) before {what}: {proc.stdout.read()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_llama_two_workers_two_ranks_resume_after_kill_export_reload(tmp_path: Path) -> None:
    run_id = _run_id("e2ellama")
    ckpt = tmp_path / "ckpt"
    overrides = [*_tiny(tmp_path), f"run_id={run_id}", "student.steps_per_stage=60",
                 "student.checkpoint_every_steps=10", f"checkpoint_dir={ckpt}"]
    first = subprocess.Popen(_cmd(overrides, tmp_path / "run1"), cwd=tmp_path, env=_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        state = ckpt / "current" / "state.json"

        def mid_stage_1() -> bool:
            return state.exists() and json.loads(state.read_text()).get("stage") == 1

        _wait_for(mid_stage_1, RUN_TIMEOUT_S, "a checkpoint inside stage 1", first)
        ranks = [pid for pid in _procs_with(run_id) if _is_rank(pid)]
        assert ranks, "no student rank found"
        os.kill(ranks[-1], signal.SIGKILL)
        first.wait(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode != 0
    _wait_gone(run_id)
    killed_at = json.loads(state.read_text())["step"]

    second = _run(overrides, tmp_path / "run2", tmp_path)
    log = second.stdout + second.stderr
    assert "stage 0 (layers [0]) already trained: skipping" in log
    assert f"stage 1: resumed at step {killed_at}" in log
    _wait_gone(run_id)

    run2 = tmp_path / "run2"
    metrics = [json.loads(line) for line in (run2 / "metrics.jsonl").read_text().splitlines()]
    stage_ends = {m["stage"] for m in metrics if m["event"] == "stage_end"}
    assert stage_ends == {1, 2}  # stage 0 was not retrained
    assert (run2 / "report.md").exists() and (run2 / "losses.png").exists()
    result = json.loads((run2 / "result.json").read_text())
    assert result["eval"]["kind"] == "lm" and result["eval"]["student"] > 0
    decode = result["decode"]  # teacher vs the exported student at a long context
    assert decode["teacher"]["context"] == decode["student"]["context"] == 8192
    assert decode["student"]["cache_bytes"] < decode["teacher"]["cache_bytes"]
    assert "decode ms/token @ 8,192" in (run2 / "report.md").read_text()
    card = (run2 / "student" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers") and "## Speed" in card and "## Quality" in card
    assisted = decode["assisted"]  # the teacher generating with the exported student drafting
    assert assisted["same"] == assisted["prompts"] == 2 and 0 <= assisted["accepted"] <= assisted["drafted"]
    assert assisted["new_tokens"] == 64 and assisted["speedup"] > 0
    for text in ((run2 / "report.md").read_text(), card):
        assert "Assisted decoding (the teacher's `generate(..., assistant_model=student)`" in text
        assert "the same tokens as the teacher alone" in text
    shown = decode["continuations"]  # the fixed prompts, continued greedily by both models
    assert [row["prompt"] for row in shown] == list(PROMPTS)
    assert all(row["teacher"] and row["student"] for row in shown)
    assert "## Greedy continuations" in (run2 / "report.md").read_text()

    from distill import load_student

    model = load_student(str(run2 / "student"))
    ids = torch.randint(0, 300, (1, 8))
    assert model(ids).logits.shape == (1, 8, model.config.vocab_size)
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 11)


def _is_rank(pid: int) -> bool:
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    environ = Path(f"/proc/{pid}/environ").read_bytes() if Path(f"/proc/{pid}/environ").exists() else b""
    return b"mode=student" in cmdline and b"torch.distributed.run" not in cmdline and b"LOCAL_RANK=" in environ


def test_bert_encoder_end_to_end(tmp_path: Path) -> None:
    """The pre-trained tiny BERT (a few masked-LM steps here), its layer stages, then an
    end-to-end stage on its final hidden state; per-layer scores come before and after it."""
    run_id = _run_id("e2ebert")
    overrides = [*_tiny(tmp_path, layers=2), "teacher=tiny_bert", "teacher.tiny.hidden_size=32",
                 "replacement=linear_attention", f"run_id={run_id}", "student.steps_per_stage=10",
                 "local.num_workers=1", "local.num_students=1",  # 2 + 2 are the Llama test's
                 "student.layers_per_stage=2", "student.e2e.steps=6", "student.val_every_steps=3",
                 f"checkpoint_dir={tmp_path / 'ckpt'}"]
    result = _run(overrides, tmp_path / "run", tmp_path)
    log = result.stdout + result.stderr
    _wait_gone(run_id)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["eval"]["kind"] == "encoder"
    assert 0 < result["eval"]["identity"] < result["eval"]["student"] <= 1.0
    assert set(result["eval"]["per_layer"]) == set(result["eval"]["per_layer_layer_stages"]) == {"0", "1"}
    assert 0 < result["summary"]["student_after_layer_stages"] <= 1.0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["event"] == "e2e_val"] == [0, 3, 6]  # 0: the layer stages' student
    assert all(0 < m["cosine"] <= 1 for m in metrics if m["event"] == "e2e_val")
    # The stage exports its best validation's weights: step 0's (the layer stages' own, when
    # six steps did not beat them) leave every per-layer score as it was; a later step's move them.
    best_step = next(m["best_step"] for m in metrics if m["event"] == "stage_end" and m["kind"] == "e2e")
    unchanged = result["eval"]["per_layer"] == result["eval"]["per_layer_layer_stages"]
    assert unchanged == (best_step == 0), (best_step, result["eval"])
    _check_data_supply_and_time_split(tmp_path / "run", log)
    # The whole run's line (issue 39 item 3): the end-to-end stage counted and projected from the
    # timed teacher forward; and the supervisor names the command that reaches its broker (item 5).
    students = (tmp_path / "run" / "student.log").read_text()
    assert re.search(r"stage 1/2, 62% of the steps, ~\d+(m\d\ds|s) left", students), students[-3000:]
    assert "end-to-end stage (6 steps, ~" in students and "stage 2/2, 100% of the steps" in students
    assert re.search(r"this run's broker counters: .* -m distill mode=stats pipeline\.socket_dir=/\S+" + run_id + "-", log)

    # The same command again: every stage comes finished from its checkpoint, nothing is
    # trained (so no metrics.jsonl), and the run still exports, evaluates and reports.
    again = _run(overrides, tmp_path / "again", tmp_path)
    assert "no stage was trained in this run" in again.stdout + again.stderr
    assert (tmp_path / "again" / "report.md").exists()
    assert json.loads((tmp_path / "again" / "result.json").read_text())["eval"]["kind"] == "encoder"
    # Issue 39 item 6: the options as typed, one time table, and why the rerun draws no curves.
    first, report = (tmp_path / "run" / "report.md").read_text(), (tmp_path / "again" / "report.md").read_text()
    assert "| `replacement` | linear_attention |" in first and "| `teacher` | tiny_bert |" in first
    assert "distill.replacements" not in first and first.count(" | seconds | ") == 1
    assert "layers [0, 1] were not trained by this run" in report and not (tmp_path / "again" / "losses.png").exists()
    _wait_gone(run_id)


def test_joint_schedule_trains_every_layer_in_one_stage_on_two_ranks(tmp_path: Path) -> None:
    """student.schedule=joint: one stage of all layers, fed the embeddings alone (the ranks run
    the chain and average their gradients without DDP), exported and evaluated like any run."""
    run_id = _run_id("jointllama")
    overrides = [*_tiny(tmp_path), f"run_id={run_id}", "student.schedule=joint", "student.steps_per_stage=8",
                 "student.val_every_steps=4", "local.num_workers=1"]
    _run(overrides, tmp_path / "run", tmp_path)
    _wait_gone(run_id)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ends = [(m["layers"], m["kind"], m["steps"]) for m in metrics if m["event"] == "stage_end"]
    assert ends == [([0, 1, 2], "layers", 8)]
    assert all(set(m["layer_losses"]) == {"0", "1", "2"} for m in metrics if m["event"] == "train")
    assert [m["step"] for m in metrics if m["event"] == "val"] == [4, 8]
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["summary"]["schedule"] == "joint"
    assert set(result["eval"]["per_layer"]) == {"0", "1", "2"}
    assert result["eval"]["student"] > 0


def _check_data_supply_and_time_split(run: Path, log: str) -> None:
    """Each stage reports how well the teachers fed it (and says so when they did not);
    the run's wall time is split into teacher, transport, student compute and waiting."""
    from distill.train.trainer import STARVED_FRACTION

    stage_ends = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
                  if json.loads(line)["event"] == "stage_end"]
    assert stage_ends
    for end in stage_ends:
        assert 0 <= end["wait_fraction"] < 1
        assert 0 < end["delivered_samples_per_s"] <= end["needed_samples_per_s"]
        starved = f"stage {end['stage']} was teacher-bound" in log
        assert starved == (end["wait_fraction"] >= STARVED_FRACTION), (end, log[-2000:])
    split = json.loads((run / "result.json").read_text())["time_split"]
    assert split["teacher forward (mean per worker)"] > 0
    assert split["student compute"] > 0
    # the student's phases outside its steps are timed, not left in the remainder
    for phase in ("student start (imports, teacher and data loading)",
                  "student stage setup (replacements, held-out teacher targets)", "student assembly and export"):
        assert split[phase] > 0, (phase, split)
    student_lane = sum(v for k, v in split.items() if k.startswith("student"))
    assert abs(student_lane - split["wall_s"]) < 0.05 * split["wall_s"]
    assert "## Where the time went" in (run / "report.md").read_text()


@pytest.mark.parametrize("fault", ["sigint", "ctrl_c", "worker_dies"])
def test_local_tears_everything_down(tmp_path: Path, fault: str) -> None:
    """SIGINT to the supervisor, Ctrl-C as a terminal sends it (to the whole process group), or a
    teacher killed: every process goes, and the last line says what happened."""
    marker = _run_id(f"e2e{fault.replace('_', '')}")
    overrides = [*_tiny(tmp_path), f"run_id={marker}", "student.steps_per_stage=100000",
                 "local.num_workers=1",  # one teacher is enough to kill; both DDP ranks must go
                 f"checkpoint_dir={tmp_path / 'ckpt'}"]
    proc = subprocess.Popen(_cmd(overrides, tmp_path / "run"), cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=fault == "ctrl_c")
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, RUN_TIMEOUT_S, "training", proc)
        if fault == "sigint":
            proc.send_signal(signal.SIGINT)
        elif fault == "ctrl_c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            workers = [p for p in _procs_with(marker)
                       if b"mode=worker" in Path(f"/proc/{p}/cmdline").read_bytes()]
            os.kill(workers[0], signal.SIGKILL)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    _wait_gone(marker)
    last = [line for line in output.splitlines() if line.strip()][-1]
    if fault != "worker_dies":  # one line, after every process stopped, and the shell's code of a Ctrl-C
        assert (proc.returncode, last) == (INTERRUPTED_EXIT_CODE, INTERRUPTED), output[-3000:]
        assert "Traceback" not in output, output[-3000:]  # torchrun's, on SIGTERM, is in students.err
    else:  # which process, how it ended, its last error line and its log
        assert proc.returncode == 1, output[-3000:]
        assert last.startswith("worker0 was killed by SIGKILL; last error line: "), output[-3000:]
        assert last.endswith(f"; full log: {tmp_path / 'run' / 'worker0.out'}"), output[-3000:]


def test_multirun_gives_each_job_its_own_run_and_a_summary(tmp_path: Path) -> None:
    overrides = [*_tiny(tmp_path, layers=1), "local.num_workers=1", "local.num_students=1",
                 "student.steps_per_stage=4", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    cmd = [sys.executable, "-m", "distill", "-m", "mode=local", "replacement=mlp,lowrank", *overrides]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                            env=_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    jobs = sorted((tmp_path / "sweep").glob("*/result.json"))
    assert len(jobs) == 2
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert "| mlp |" in summary and "| lowrank |" in summary  # the options typed, not classes
    # bench/real.py scores a sweep's students against their teacher on a second corpus
    corpus = tmp_path / "second.txt.gz"
    with gzip.open(corpus, "wt") as f:
        f.write("A corpus none of the runs trained on, long enough for a few chunks. " * 200)
    bench = subprocess.run([sys.executable, str(ROOT / "bench" / "real.py"), *(str(job.parent) for job in jobs),
                            f"--corpus={corpus}", "--corpus-chunks=4"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=RUN_TIMEOUT_S, env=_env())
    assert bench.returncode == 0, bench.stderr[-3000:]
    table = bench.stdout.splitlines()
    teacher_ppl = json.loads(jobs[0].read_text())["eval"]["teacher"]  # what the runs measured: the same split
    assert re.fullmatch(rf"\| teacher \| {teacher_ppl:.2f} \| 1\.000x \| [0-9.]+ \| 1\.000x \|", table[2]), table
    assert any("(mlp) |" in line for line in table) and any("(lowrank) |" in line for line in table), table
