"""What a run writes: checkpoints (:mod:`.checkpoint`), metrics
(:mod:`.metrics`), the run folder (:mod:`.run_folder`) and where each of its files is (:mod:`.layout`)."""
