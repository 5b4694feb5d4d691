"""tests/conftest.py's pytest-xdist groups: a module is one group, the fault modules one serial
group, and modules sharing an expensive session fixture one group, so it starts once."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

from tests.conftest import _groups


@dataclass
class Item:
    nodeid: str
    fixturenames: list[str] = field(default_factory=list)
    scopes: dict[str, str] = field(default_factory=dict)  # fixture name -> its scope; default session

    @property
    def _fixtureinfo(self):
        defs = {name: [SimpleNamespace(scope=self.scopes.get(name, "session"))] for name in self.fixturenames}
        return SimpleNamespace(name2fixturedefs=defs)


def test_each_module_is_its_own_group_without_shared_fixtures():
    items = [Item("tests/a/test_x.py::t1", ["tokenizer"]), Item("tests/a/test_x.py::t2"),
             Item("tests/b/test_y.py::t", ["tokenizer", "tmp_path"])]
    assert _groups(items) == {"tests/a/test_x.py": "tests/a/test_x.py", "tests/b/test_y.py": "tests/b/test_y.py"}


def test_modules_sharing_a_session_fixture_are_one_group_and_chains_join():
    items = [Item("tests/api/test_a.py::t", ["backend", "stack_api"]),
             Item("tests/api/test_b.py::t", ["backend", "engine_f32"]),
             Item("tests/e2e/test_c.py::t", ["engine_f32"]),
             Item("tests/e2e/test_d.py::t", ["hf_model"]),
             Item("tests/e2e/test_e.py::t", ["tokenizer"])]
    shared = "session+backend+engine_f32"
    assert _groups(items) == {"tests/api/test_a.py": shared, "tests/api/test_b.py": shared,
                              "tests/e2e/test_c.py": shared, "tests/e2e/test_d.py": "session+hf_model",
                              "tests/e2e/test_e.py": "tests/e2e/test_e.py"}


def test_a_module_fixture_of_the_same_name_is_not_shared():
    items = [Item("tests/api/test_a.py::t", ["backend"]),
             Item("tests/api/test_p.py::t", ["backend"], scopes={"backend": "module"})]
    assert _groups(items) == {"tests/api/test_a.py": "session+backend", "tests/api/test_p.py": "tests/api/test_p.py"}


def test_the_fault_modules_are_one_serial_group_even_when_sharing():
    items = [Item("tests/faults/test_r.py::t"), Item("tests/faults/test_s.py::t", ["engine_f32"]),
             Item("tests/e2e/test_c.py::t", ["engine_f32"])]
    assert set(_groups(items).values()) == {"faults"}


def test_the_groups_are_marked_before_xdist_reads_them():
    """xdist's own pytest_collection_modifyitems turns xdist_group marks into node id suffixes;
    conftest's hooks run after it unless tryfirst, and then no test has a group: each test is
    scheduled alone, and every module fixture starts on both workers."""
    from tests import conftest

    assert conftest.pytest_collection_modifyitems.pytest_impl.get("tryfirst") is True
