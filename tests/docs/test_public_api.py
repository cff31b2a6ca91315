"""The public API is importable as documented: `__all__` and every `from moerules... import` in the README."""

import importlib
import re
from pathlib import Path

import pytest

import moerules

README = Path(__file__).resolve().parents[2] / "README.md"
_IMPORT = re.compile(r"^\s*from (moerules[\w.]*) import ([^#\n]+)", re.MULTILINE)


def test_star_import_gives_every_name_of_all():
    namespace: dict = {}
    exec("from moerules import *", namespace)  # noqa: S102 - the statement under test
    assert sorted(set(moerules.__all__) - set(namespace)) == []


@pytest.mark.parametrize("name", moerules.__all__)
def test_each_public_name_imports_by_name(name):
    namespace: dict = {}
    exec(f"from moerules import {name}", namespace)  # noqa: S102
    assert namespace[name] is getattr(moerules, name)


def test_the_errors_are_the_classes_raised():
    from moerules import KernelUnavailableError, MoeRulesError
    from moerules.errors import KernelUnavailableError as raised
    assert KernelUnavailableError is raised and issubclass(KernelUnavailableError, MoeRulesError)


def test_every_import_the_readme_shows_resolves():
    imports = _IMPORT.findall(README.read_text(encoding="utf-8"))
    assert imports, "the README shows no moerules imports: the pattern is stale"
    for module, names in imports:
        loaded = importlib.import_module(module)
        for name in names.replace("(", "").replace(")", "").split(","):
            name = name.split(" as ")[0].strip()
            if name and name != "*":
                assert hasattr(loaded, name), f"README: from {module} import {name}"
