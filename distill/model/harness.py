"""lm-evaluation-harness on a model object: the ecosystem's zero-shot scores for a student and its teacher.

lm-evaluation-harness is an optional extra (``pip install -e .[eval]``); it is imported here,
inside :func:`harness_scores`, only when ``mode=eval`` runs (the one lazy import of this
module, kept out of every other mode's start). Models are handed to the harness as loaded
objects (its ``HFLM(pretrained=<model>)``), so the student runs through exactly the code
``load_student`` and ``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` give.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# Above 0 so the table has standard errors: the harness computes a mean's (accuracy) in
# closed form whatever the count, and bootstraps only metrics such as F1 or BLEU; at 0 it
# gives none, and a 200-question gap of 3 points cannot be told from noise.
BOOTSTRAP_ITERS = 1000
INSTALL_HINT = "mode=eval needs lm-evaluation-harness: pip install -e '.[eval]' (or pip install lm-eval)"


def harness_scores(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    tasks: list[str],
    include_path: str | None = None,
    num_fewshot: int | None = None,
    limit: float | None = None,
    batch_size: int = 8,
) -> dict[str, Any]:
    """The harness's ``results`` dict ({task: {"acc,none": ..., "acc_stderr,none": ...}}) for ``model``."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as err:
        raise ValueError(INSTALL_HINT) from err
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, log_samples=False,
        task_manager=TaskManager(include_path=include_path), bootstrap_iters=BOOTSTRAP_ITERS,
    )
    return out["results"]
