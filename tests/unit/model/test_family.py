"""Family adapters: every supported family run right, every kind built right or refused up front.

For each family of ``tests.tiny_teachers`` (family features on): the teacher run layer by
layer (``embed``, ``run_layer``, ``final_logits``) equals HF's own forward; each replacement
kind the family takes is built, exported, loaded, equals the in-run model, decodes the same
with and without its cache and batches left-padded prompts as one by one; each kind it
cannot take is refused by ``check_kind`` and by the replacement itself, naming the feature;
the in-run evaluation's student figure is the exported student's.

Shape legend: B batch, T tokens, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from distill.model import family as families
from distill.model.assemble import export_student, load_student
from distill.model.evaluate import evaluate
from distill.model.teacher import Teacher
from distill.replacements.mlp import ResidualMLP
from distill.replacements.pruned import PrunedLayer
from tests.tiny_teachers import (
    DECODER_FAMILIES,
    ENCODER_FAMILIES,
    SEQ_LEN,
    family_config,
    family_model,
)
from tests.unit.model.test_native import KINDS as NATIVE_KINDS

CONF = Path(__file__).resolve().parents[3] / "conf" / "replacement"
VOCAB, NEW = 96, 5
KINDS = NATIVE_KINDS  # the kinds and options test_native builds, on every family here
CFG = {"_target_": "recorded.only", "_partial_": True}
TAKEN = [(name, kind) for name in DECODER_FAMILIES for kind in KINDS
         if kind not in families.FAMILIES[name].refused_kinds]
REFUSED = [(name, kind) for name in DECODER_FAMILIES for kind in families.FAMILIES[name].refused_kinds]


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _ids(batch: int, seed: int, length: int = SEQ_LEN) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------- detection


def test_every_supported_family_is_detected_by_its_model_type() -> None:
    for name in DECODER_FAMILIES + ENCODER_FAMILIES:
        family = families.detect(family_config(name))
        assert family.name == name
        assert family.modeling == ("bert" if name in ENCODER_FAMILIES else "llama")


@pytest.mark.parametrize("model_type", sorted(families.NOT_SUPPORTED))
def test_a_known_unsupported_family_is_refused_naming_its_feature(model_type: str) -> None:
    with pytest.raises(ValueError, match="Unsupported teacher family") as err:
        families.detect({"model_type": model_type, "num_hidden_layers": 2})
    assert families.NOT_SUPPORTED[model_type] in str(err.value) and "llama" in str(err.value)


def test_structure_alone_never_makes_a_family() -> None:
    """A config with a model_type distill has no adapter for is refused, whatever its modules look like."""
    with pytest.raises(ValueError, match="has no adapter"):
        families.detect({"model_type": "my_llama_lookalike"})


def test_every_replacement_option_in_conf_has_a_kind() -> None:
    targets = {yaml.safe_load(path.read_text())["_target_"]: path.stem for path in CONF.glob("*.yaml")}
    assert targets == families.KIND_OF_TARGET


# ---------------------------------------------------------------------- the teacher runner


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                      reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("name", DECODER_FAMILIES + ENCODER_FAMILIES)
def test_the_teacher_run_layer_by_layer_equals_hfs_own_forward(name: str, device: str) -> None:
    model = family_model(name).to(device)
    teacher = Teacher(model, device=device)
    ids_BT = _ids(3, seed=2).to(device)
    with torch.no_grad():
        hidden_BTD = teacher.embed(ids_BT)
        for layer in teacher.layers:
            hidden_BTD = teacher.run_layer(layer, hidden_BTD)
        if name in DECODER_FAMILIES:
            torch.testing.assert_close(teacher.final_logits(hidden_BTD), model(ids_BT).logits, rtol=0, atol=1e-5)
        else:
            torch.testing.assert_close(teacher.final_hidden(hidden_BTD), model(ids_BT).last_hidden_state,
                                       rtol=0, atol=1e-5)
        captured = teacher.capture(ids_BT, [teacher.num_layers - 1])[teacher.num_layers - 1][1]
    torch.testing.assert_close(captured, hidden_BTD, rtol=0, atol=1e-5)


# ---------------------------------------------------------------------- every kind, every decoder family


def _replacements(teacher: Teacher, kind: str) -> dict[int, torch.nn.Module]:
    cls, options = KINDS[kind]
    built = {idx: cls(teacher, idx, **options) for idx in (1, 2)}
    with torch.no_grad():
        for module in built.values():
            for param in module.parameters():
                param.add_(torch.randn_like(param) * 0.05)
    return built


def _greedy(model: torch.nn.Module, ids_BT: torch.Tensor, use_cache: bool, mask_BT: torch.Tensor | None = None):
    return model.generate(ids_BT, attention_mask=mask_BT, max_new_tokens=NEW, do_sample=False, use_cache=use_cache,
                          pad_token_id=0)


@pytest.mark.parametrize(("name", "kind"), TAKEN)
def test_each_kind_exports_loads_decodes_and_pads_right_on_each_decoder_family(
        name: str, kind: str, tmp_path: Path) -> None:
    teacher = Teacher(family_model(name))
    replacements = _replacements(teacher, kind)
    out = tmp_path / f"{name}-{kind}"
    export_student(teacher, name, replacements, dict.fromkeys(replacements, CFG), str(out))
    student = load_student(str(out))
    ids_BT = _ids(2, seed=1)
    with torch.no_grad():
        hidden_BTD = teacher.embed(ids_BT)
        for idx, layer in enumerate(teacher.layers):
            module = replacements.get(idx)
            hidden_BTD = module(hidden_BTD) if module is not None else teacher.run_layer(layer, hidden_BTD)
        torch.testing.assert_close(student(ids_BT).logits, teacher.final_logits(hidden_BTD), rtol=0, atol=1e-5)
    assert torch.equal(_greedy(student, ids_BT, True), _greedy(student, ids_BT, False))
    seqs = [_ids(1, seed=5)[0], _ids(1, seed=6)[0, :7]]
    width = max(len(s) for s in seqs)
    padded_BT, mask_BT = torch.zeros(2, width, dtype=torch.long), torch.zeros(2, width, dtype=torch.long)
    for row, seq in enumerate(seqs):
        padded_BT[row, width - len(seq):], mask_BT[row, width - len(seq):] = seq, 1
    batch = _greedy(student, padded_BT, True, mask_BT)
    for row, seq in enumerate(seqs):
        assert torch.equal(batch[row, width:], _greedy(student, seq[None], True)[0, len(seq):]), (name, kind, row)


@pytest.mark.parametrize(("name", "kind"), REFUSED)
def test_a_kind_a_family_cannot_take_is_refused_naming_the_feature(name: str, kind: str) -> None:
    family = families.FAMILIES[name]
    with pytest.raises(ValueError, match=f"replacement={kind} cannot reproduce the {name}") as err:
        families.check_kind(family, kind)
    assert family.refused_kinds[kind] in str(err.value) and "Choose one of replacement=" in str(err.value)
    cls, options = KINDS[kind]
    with pytest.raises(ValueError, match=kind):
        cls(Teacher(family_model(name)), 1, **options)


def test_a_set_option_a_family_cannot_take_is_refused_and_the_kind_still_works() -> None:
    teacher = Teacher(family_model("olmo2"))
    with pytest.raises(ValueError, match="replacement.num_key_value_heads cannot be used with the olmo2"):
        PrunedLayer(teacher, 1, num_key_value_heads=1)
    with pytest.raises(ValueError, match="q/k norms"):
        families.check_teacher(family_config("olmo2"), "pruned", {"num_key_value_heads": 1, "kv_merge": "mean"})
    PrunedLayer(teacher, 1, mlp_keep_fraction=0.5)


# ---------------------------------------------------------------------- the report measures the export


@pytest.mark.parametrize("name", ["gemma2", "granite", "mistral"])
def test_the_in_run_evaluation_scores_the_exported_student_and_hfs_teacher(name: str, tmp_path: Path) -> None:
    """Perplexities the report shows equal those of HF's forward of the teacher and of the export."""
    model = family_model(name)
    teacher = Teacher(model)
    replacements = {1: ResidualMLP(teacher, 1, hidden_mult=1.0)}
    out = tmp_path / "student"
    export_student(teacher, name, replacements, dict.fromkeys(replacements, CFG), str(out))
    heldout_NT = _ids(4, seed=9)
    result = evaluate(teacher, replacements, heldout_NT, batch_size=2)
    student = load_student(str(out))
    with torch.no_grad():
        for figure, scorer in ((result.teacher, model), (result.student, student)):
            logits_NTV = scorer(heldout_NT).logits[:, :-1]
            nll = torch.nn.functional.cross_entropy(logits_NTV.flatten(0, 1), heldout_NT[:, 1:].flatten())
            assert math.isclose(figure, math.exp(nll.item()), rel_tol=1e-5), (name, figure, math.exp(nll.item()))


# ---------------------------------------------------------------------- the README says what is true


def _readme_rows() -> dict[str, list[str]]:
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    rows = {}
    for line in readme.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("  | `") and len(cells) == 5:  # the family table, indented under its bullet
            rows[cells[0].strip("`")] = cells[1:4]
    return rows


def test_the_readme_family_table_is_the_adapters_table() -> None:
    rows = _readme_rows()
    assert set(rows) == set(families.FAMILIES)
    groups = (("copy", "mlp", "lowrank"), ("pruned",), families.LINEAR_KINDS)
    for name, cells in rows.items():
        family = families.FAMILIES[name]
        for kinds, cell in zip(groups, cells, strict=True):
            refused = [kind for kind in kinds if kind in family.refused_kinds]
            if cell.startswith(("yes", "no")):
                assert cell.startswith("no") == bool(refused), (name, kinds, cell)
            else:  # "`copy`, `mlp`; no `lowrank`: ...": the kinds named before "no" are taken, the rest refused
                taken = cell.split("no")[0]
                assert all((f"`{kind}`" in taken) == (kind not in refused) for kind in kinds), (name, cell)
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    assert all(f"`{model_type}`" in readme for model_type in families.NOT_SUPPORTED)
