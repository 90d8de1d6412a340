"""The documentation site's generated reference: every setting of the job's config
(:mod:`.settings`), every command's flags (:mod:`.commands`), every registry entry
(:mod:`.registries`), rendered as the site's pages (:mod:`.pages`); docstrings' Sphinx roles as
the site's cross-references (:mod:`.roles`). ``mkdocs build`` runs them (``docs/hooks.py``)."""
