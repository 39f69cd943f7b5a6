from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # on a shared, busy 2-core machine one intra-op thread is many times faster than two
    # spinning against other processes; these tests are about values, not parallel speed
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
