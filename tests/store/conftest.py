import itertools

import fsspec
import pytest

_memory_runs = itertools.count()


@pytest.fixture(params=["local", "memory"])
def run_url(request: pytest.FixtureRequest, tmp_path) -> str:
    """A fresh run location: a local directory, or a ``memory://`` URL (cleaned up after)."""
    if request.param == "local":
        yield str(tmp_path / "run")
        return
    url = f"memory://store-tests/run-{next(_memory_runs)}"
    yield url
    fs, root = fsspec.core.url_to_fs(url)
    if fs.exists(root):
        fs.rm(root, recursive=True)
