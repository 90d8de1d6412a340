"""The site's build-time code (mkdocs.yml names it twice).

- An mkdocs hook: the reference pages (``reference/*.md``) are generated from the code as the site
  builds (:data:`purerl.docs.pages.PAGES`), replacing any file of that name in ``docs/``.
- A Griffe extension for mkdocstrings: purerl's docstrings name code with Sphinx roles, which
  become cross-references of the site (:func:`purerl.docs.roles.markdown`).
"""

import sys
from pathlib import Path

import griffe
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's purerl, installed or not

from purerl.docs.pages import PAGES  # noqa: E402
from purerl.docs.roles import markdown  # noqa: E402


def on_files(files: Files, config: dict) -> Files:
    """The generated reference pages added to the site's files."""
    for path, page in PAGES.items():
        if (existing := files.get_file_from_path(path)) is not None:
            files.remove(existing)
        files.append(File.generated(config, path, content=page()))
    return files


class SphinxRoles(griffe.Extension):
    """Each docstring's Sphinx roles as autorefs cross-references, as Griffe loads it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: object) -> None:
        if obj.docstring is not None:
            module = obj.module
            obj.docstring.value = markdown(obj.docstring.value, module.path, package=module.is_init_module)
