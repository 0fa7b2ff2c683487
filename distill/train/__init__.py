"""The student's training library: the stage trainer, closed-loop inputs, the end-to-end
stage, checkpoints, stopping rules, host-to-device transfer and the student's timing. It
never imports ``modes``, ``results`` or the teacher worker's side (``distill.teacher``);
what both sides agree on lies below them (``distill.stages``, ``distill.transport``)."""
