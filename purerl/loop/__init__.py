"""The driver loops: they sequence effects and call the step function, and do no maths.

:mod:`.sampling` (a step's batch: prompts, responses, rewards; dynamic sampling, ReMax baselines),
:mod:`.evaluation` (held-out greedy accuracy), :mod:`.train` (synchronous), :mod:`.async_train`
(a generator thread and a bounded queue), :mod:`.recording` (evaluation, metrics, checkpoints and
stop requests around each step).
"""
