"""distill: layer-by-layer distillation of HuggingFace transformers.

``python -m distill`` runs it; ``distill.pipeline`` is the transport underneath;
``from distill import load_student`` loads an exported student.
"""


def __getattr__(name: str):
    """Lazy top-level API, so ``import distill.pipeline`` does not import transformers."""
    if name == "load_student":
        from distill.assemble import load_student

        return load_student
    raise AttributeError(f"module 'distill' has no attribute {name!r}")
