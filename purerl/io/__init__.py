"""What a run writes: checkpoints (:mod:`.checkpoint`), the HF export (:mod:`.export`), metrics
(:mod:`.metrics`) and the run folder (:mod:`.run_folder`)."""
