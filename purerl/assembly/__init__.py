"""The assembly: where a job's config (:class:`~purerl.config.job.JobConfig`) becomes what runs.
Nothing below this layer names ``JobConfig`` (an import-linter contract keeps it so): stages take
their own settings (:mod:`purerl.step.settings`), loops and executors their sections.

- :mod:`.stages`: the stages' bound settings, optimizers, KL controller, step function and batch
  plan; :func:`~.stages.policy_loss` and :func:`~.stages.advantage_estimator` for scripts;
- :mod:`.data`: records, reward function, episodes, tasks;
- :mod:`.models`: policy, critic, the state at step 0, the engine's options;
- :mod:`.executor`: the local or the Ray executor;
- :mod:`.tiny`: a tiny model, engine and task for scripts and tests.

:func:`purerl.run.run` strings them together into the job.
"""
