"""HF models and data: the frozen teacher, where it and the corpus come from, the tiny
offline teachers, LoRA, the student's assembly/export/loading, and evaluation."""
