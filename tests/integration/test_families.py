"""Every supported family's copy student *is* its teacher, loaded as a user loads it.

For each family of ``tests.tiny_teachers.family_config`` (the family's own features on:
Gemma's embedding scale, Gemma-2's soft-caps and eager attention, Granite's multipliers,
Mistral's window shorter than the chunk, Qwen2's mixed sliding and full layers, Phi-3's
fused projections, OLMo-2's post-norms), every layer is replaced by ``copy``, the student
is exported, and a fresh ``python -I`` that cannot import distill loads it with the Auto
classes (``trust_remote_code=True``). Its logits (decoders) or last hidden state
(encoders) must equal HF's own forward of the teacher to 1e-5, and its greedy generation
with the cache must give the teacher's tokens. The config the student loads with must
carry every field the teacher's forward reads, attention implementation included, so a
feature a future export drops fails here rather than in a user's hands.

Shape legend: B batch, T tokens.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from distill.model.assemble import export_student
from distill.model.teacher import Teacher
from distill.replacements.teacher_copy import TeacherCopy
from tests.tiny_teachers import DECODER_FAMILIES, ENCODER_FAMILIES, SEQ_LEN, family_model

FAMILIES = DECODER_FAMILIES + ENCODER_FAMILIES
CFG = {"_target_": "recorded.only", "_partial_": True}
NEW_TOKENS = 6

USER_SCRIPT = r'''
import json, sys
sys.modules["distill"] = None  # any `import distill` now raises ModuleNotFoundError
import torch
from transformers import AutoModel, AutoModelForCausalLM
dirs, ids_path, out_path = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
ids = torch.load(ids_path)
out = {}
for name, (path, decoder) in dirs.items():
    model_cls = AutoModelForCausalLM if decoder else AutoModel
    model = model_cls.from_pretrained(path, trust_remote_code=True).eval()
    config = {}
    for key in dir(model.config):
        try:
            value = getattr(model.config, key)
        except Exception:
            continue
        if not key.startswith("__") and not callable(value):
            config[key] = value
    with torch.no_grad():
        if decoder:
            result = {"logits": model(ids).logits,
                      "generated": model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True)}
        else:
            result = {"hidden": model(ids).last_hidden_state}
    result["config"] = json.loads(json.dumps(config, default=str))
    result["class"] = type(model).__name__
    out[name] = result
out["distill_loaded"] = any(m == "distill" or m.startswith("distill.") for m in sys.modules
                            if sys.modules[m] is not None)
torch.save(out, out_path)
'''.replace("NEW_TOKENS", str(NEW_TOKENS))


class _ReadKeys:
    """Records the config attributes a model's forward reads (its config's class swapped for the call)."""

    def __init__(self, config) -> None:
        self.config, self.keys = config, set()

    def __enter__(self) -> set[str]:
        keys, original = self.keys, type(self.config)

        def recording(obj, name):
            value = original.__getattribute__(obj, name)  # only fields that exist are recorded
            if not name.startswith("__"):
                keys.add(name)
            return value

        self._original = original
        self.config.__class__ = type(f"Recording{original.__name__}", (original,), {"__getattribute__": recording})
        return keys

    def __exit__(self, *exc) -> None:
        self.config.__class__ = self._original


@pytest.fixture(scope="module")
def loaded(tmp_path_factory) -> dict:
    """Export every family's copy student, load all of them in one process without distill."""
    tmp_path = tmp_path_factory.mktemp("families")
    ids_BT = torch.randint(3, 90, (2, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    torch.save(ids_BT, tmp_path / "ids.pt")
    dirs, teachers = {}, {}
    for name in FAMILIES:
        model = family_model(name)
        teacher = Teacher(model)
        copies = {idx: TeacherCopy(teacher, idx) for idx in range(teacher.num_layers)}
        out = tmp_path / name
        export_student(teacher, name, copies, dict.fromkeys(copies, CFG), str(out))
        dirs[name] = (str(out), name in DECODER_FAMILIES)
        teachers[name] = model
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "hf_modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-I", "-c", USER_SCRIPT, json.dumps(dirs), str(tmp_path / "ids.pt"), str(tmp_path / "out.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return {"out": torch.load(tmp_path / "out.pt"), "teachers": teachers, "ids": ids_BT}


def test_the_user_process_did_not_import_distill(loaded: dict) -> None:
    assert loaded["out"]["distill_loaded"] is False


@pytest.mark.parametrize("name", FAMILIES)
def test_the_copy_student_equals_the_teachers_own_forward(loaded: dict, name: str) -> None:
    teacher, ids_BT, student = loaded["teachers"][name], loaded["ids"], loaded["out"][name]
    with torch.no_grad():
        if name in DECODER_FAMILIES:
            torch.testing.assert_close(student["logits"], teacher(ids_BT).logits, rtol=0, atol=1e-5)
        else:
            torch.testing.assert_close(student["hidden"], teacher(ids_BT).last_hidden_state, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", DECODER_FAMILIES)
def test_the_copy_student_generates_the_teachers_greedy_tokens_with_its_cache(loaded: dict, name: str) -> None:
    teacher, ids_BT = loaded["teachers"][name], loaded["ids"]
    with torch.no_grad():
        expected = teacher.generate(ids_BT, max_new_tokens=NEW_TOKENS, do_sample=False, use_cache=True)
    assert torch.equal(loaded["out"][name]["generated"], expected)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_student_config_keeps_every_field_the_teachers_forward_reads(loaded: dict, name: str) -> None:
    teacher, ids_BT = loaded["teachers"][name], loaded["ids"]
    with torch.no_grad(), _ReadKeys(teacher.config) as read:
        teacher(ids_BT)
    student = loaded["out"][name]["config"]
    expected = json.loads(json.dumps({k: getattr(teacher.config, k) for k in read}, default=str))
    lost = {k: (v, student.get(k, "<missing>")) for k, v in expected.items()
            if not callable(getattr(teacher.config, k)) and student.get(k, "<missing>") != v
            and k not in _NOT_THE_TEACHERS and not (name in ENCODER_FAMILIES and k == "use_cache")}
    assert not lost, f"the export drops or changes fields the {name} teacher's forward reads: {lost}"


_NOT_THE_TEACHERS = {"model_type", "architectures", "auto_map", "transformers_version", "_name_or_path",
                     "name_or_path", "_commit_hash", "dtype", "torch_dtype", "layer_types", "per_layer_config"}
"""Fields naming the teacher's own class, file or the student's cache types: the student has its own
(and an encoder student keeps no cache: its ``use_cache`` is False whatever the teacher's)."""
