"""distill: layer-by-layer distillation of HuggingFace transformers.

``python -m distill`` runs it; ``distill.pipeline`` is the transport underneath;
``from distill import load_student`` loads an exported student.

Layout (imports flow one way, left to right): ``modes`` (entry points) -> ``results``
(report, result.json) -> ``train`` (stages, trainer) -> ``replacements`` -> ``model``
(teacher, data, export) -> ``pipeline`` (the transport); ``config`` is the schema.
"""


def __getattr__(name: str):
    """Lazy top-level API, so ``import distill.pipeline`` does not import transformers."""
    if name == "load_student":
        from distill.model.assemble import load_student

        return load_student
    raise AttributeError(f"module 'distill' has no attribute {name!r}")
