"""mode=eval: lm-evaluation-harness on an exported student and its teacher, one table.

    pip install -e '.[eval]'
    python -m distill mode=eval lm_eval.student=outputs/<date>/<time>/student \
        lm_eval.tasks=[arc_easy,hellaswag,piqa]

The teacher is the one named in the student's ``distill_student.json`` unless
``lm_eval.teacher`` says otherwise; both run through the harness's ``HFLM`` on the same
tokenizer (the student's), and the table goes to the run directory (``eval.md``,
``eval.json``) and the log.
"""

from __future__ import annotations

import json
import logging
import os

from omegaconf import DictConfig
from transformers import AutoTokenizer

from distill.model.assemble import STUDENT_FILE, load_student
from distill.model.harness import harness_scores
from distill.model.teacher import Teacher
from distill.modes.process import configure_logging, run_dir
from distill.results.harness import harness_rows, write_harness_results

log = logging.getLogger(__name__)


def run_eval(cfg: DictConfig) -> None:
    """Score the teacher and the student on ``lm_eval.tasks`` and write the side-by-side table."""
    configure_logging(cfg)
    opts = cfg.lm_eval
    teacher_name = opts.teacher or _manifest_teacher(opts.student)
    # The student's own export: its config.json names remote code (auto_map), which AutoTokenizer
    # reads too; without the flag transformers asks on stdin, waits 15 s and warns of a wrong type.
    tokenizer = AutoTokenizer.from_pretrained(opts.student, trust_remote_code=True)
    scores = {}
    for name, load in (("teacher", lambda: Teacher.from_pretrained(teacher_name, device=opts.device).model),
                       ("student", lambda: load_student(opts.student, device=opts.device))):
        log.info("lm-evaluation-harness on the %s (%s)", name, teacher_name if name == "teacher" else opts.student)
        scores[name] = harness_scores(load(), tokenizer, list(opts.tasks), opts.include_path, opts.num_fewshot,
                                      opts.limit, opts.batch_size)
    rows = harness_rows(scores["teacher"], scores["student"])
    path = write_harness_results(opts.output_dir or run_dir(), rows, teacher_name, opts.student)
    log.info("teacher vs student, written to %s:\n%s", path, path.read_text())


def _manifest_teacher(student_dir: str) -> str:
    """The teacher a student was distilled from, as its distill_student.json records it."""
    with open(os.path.join(student_dir, STUDENT_FILE)) as f:
        return json.load(f)["teacher_source"]
