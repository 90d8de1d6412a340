"""The job's configuration: one typed tree (:mod:`.job`), built from files and ``key=value``
overrides (:mod:`.loading`)."""
