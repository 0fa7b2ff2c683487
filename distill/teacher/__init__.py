"""The teacher worker's side of a run: the batch function that fills slots with teacher
targets (:mod:`~distill.teacher.targets`), its device-to-slot copies
(:mod:`~distill.teacher.transfer`) and its timing file (:mod:`~distill.teacher.timing`).

It shares the stage layout (:mod:`distill.stages`) with the student side and never
imports ``train``, ``results`` or ``modes``: a worker process loads only what it runs."""
