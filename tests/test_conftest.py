"""Tests of tests/conftest.py: under `pytest -n`, a module fixture runs once.

Without the grouping, each worker that gets one of a file's tests runs its
module fixture: the flag rows' 80 s twice, and the suite took a minute more.
A change of setup.cfg's `--dist` once lost it with nothing failing.
"""

import pytest


@pytest.fixture(scope="module")
def shared():
    return object()


def test_a_test_of_a_module_fixture_runs_in_its_modules_group(request, shared):
    marker = request.node.get_closest_marker("xdist_group")
    assert marker is not None and marker.args == ("test_conftest",)
    if not hasattr(request.config, "workerinput"):
        return  # Without xdist there is nothing to schedule.
    assert request.config.getvalue("loadgroup"), "the workers do not group: --dist loadgroup?"
    assert request.node.nodeid.endswith("@test_conftest"), request.node.nodeid
