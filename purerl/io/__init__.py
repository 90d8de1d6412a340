"""What a run writes: checkpoints (:mod:`.checkpoint`), metrics
(:mod:`.metrics`) and the run folder (:mod:`.run_folder`)."""
