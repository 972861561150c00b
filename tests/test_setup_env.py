"""Set-up's choice of installer (tools/setup_env.py): uv's pip interface, except where pip is set to an index of its
own (a mirror or a private index, which uv would not read from pip's settings) or ACCEL_SETUP_PIP=1 asks for pip.
pip's own reading of its settings decides (`pip config list`), so the machine's pip files count too: the cases
below add to whatever this machine has."""
from __future__ import annotations

import pytest

from tools import setup_env


@pytest.fixture
def choice(monkeypatch):
    """A fresh choice for each case (the set-up caches it for its run)."""
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("ACCEL_SETUP_PIP", raising=False)
    setup_env.uv_or_none.cache_clear()
    yield monkeypatch
    setup_env.uv_or_none.cache_clear()


def test_an_index_of_pips_own_in_its_settings_or_environment_means_pip(choice, tmp_path):
    baseline = setup_env.pip_names_its_own_index()
    extra_only = tmp_path / "extra.conf"
    extra_only.write_text("[global]\nextra-index-url = https://mirror.example/simple\n")
    choice.setenv("PIP_CONFIG_FILE", str(extra_only))
    assert setup_env.pip_names_its_own_index() == baseline, "an extra index is beside PyPI, not instead of it"

    own = tmp_path / "own.conf"
    own.write_text("[install]\nindex-url = https://mirror.example/simple\n")
    choice.setenv("PIP_CONFIG_FILE", str(own))
    assert setup_env.pip_names_its_own_index()
    assert setup_env.uv_or_none() is None

    choice.delenv("PIP_CONFIG_FILE")
    choice.setenv("PIP_INDEX_URL", "https://mirror.example/simple")
    assert setup_env.pip_names_its_own_index()


def test_accel_setup_pip_means_pip(choice):
    choice.setenv("ACCEL_SETUP_PIP", "1")
    assert setup_env.uv_or_none() is None
