"""Where user code runs: reward functions and environment steps, loaded by name (:mod:`.loading`),
called in the form they are written in (:mod:`.forms`), in worker processes with hard per-call
deadlines or on threads (:mod:`.processes`). The worker processes import only this package, not
torch and not the trainer's script."""
