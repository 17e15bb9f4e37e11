"""flexspec's top-level import names must not shadow another installed distribution's.

transformers >= 5.25 depends on Hugging Face's ``kernels`` and imports it whenever that distribution is
installed; a repo-root package of the same name (ours was ``kernels/`` until 2026-12) was imported in its
place and every model load failed with ``ImportError: cannot import name 'CUDAProperties'``.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _our_top_level_packages() -> list[str]:
    """Import names the wheel installs: repo-root packages matched by pyproject's ``packages.find.include``."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    names = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    return [n for n in names if any(pathlib.PurePath(n).match(pat) for pat in patterns)]


def test_wheel_ships_the_engine_and_kernels():
    names = _our_top_level_packages()
    assert {"flexspec", "flexspec_kernels", "configs", "actors", "cluster", "bench"} <= set(names), names


def test_no_top_level_name_belongs_to_another_distribution():
    owners = importlib.metadata.packages_distributions()
    clashes = {n: owners[n] for n in _our_top_level_packages() if set(owners.get(n, [])) - {"flexspec"}}
    assert not clashes, f"these import names are also installed by other distributions: {clashes}"


def test_transformers_hub_kernels_integration_imports():
    # The exact import that failed when our package shadowed Hugging Face's ``kernels``.
    from transformers.integrations import hub_kernels

    assert hub_kernels is not None
