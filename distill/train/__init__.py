"""The training library: stage layout, the stage trainer, closed-loop inputs, the
end-to-end stage, checkpoints, stopping rules, host/device transfer, timing, and the
mapping of ``cfg.pipeline`` to the transport. It never imports ``modes`` or ``results``."""
