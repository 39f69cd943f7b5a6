import pytest

from inshrinkerator.bench import workloads

from .tiny_workload import TinyWorkload


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> str:
    """Registers the tiny workload for the duration of a test; returns its name."""
    monkeypatch.setitem(workloads.WORKLOADS, TinyWorkload.name, TinyWorkload)
    return TinyWorkload.name
