"""The documentation's pages from an installed purerl, where the checkout's scripts (``experiments/``,
``bench/``) are absent: the pages that read only the package build; the flags page, which reads the
scripts, refuses in one line naming the missing file and the fix (build from a clone)."""

import pytest

import purerl.docs.commands as commands
from purerl.docs.pages import flags_page, registries_page, settings_page


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The root an installed package sees: a site-packages folder with no checkout's scripts."""
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.setattr(commands, "ROOT", site)
    return site


def test_the_flags_page_of_an_installed_package_says_in_one_line_it_needs_a_checkout(installed):
    with pytest.raises(commands.CheckoutMissing) as caught:
        flags_page()
    message = str(caught.value)
    assert "\n" not in message
    assert f"experiments/grpo_math.py is not in {installed}" in message
    assert "build the documentation from a clone of the purerl repository" in message


def test_the_pages_read_from_the_package_alone_build_without_a_checkout(installed):
    assert "# Settings" in settings_page() and "# Registries" in registries_page()
