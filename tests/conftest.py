import os

import pytest
import torch

from tests.s3_server import s3_bucket  # noqa: F401  (a fixture: a moto S3 server and bucket per module)

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def pytest_report_header(config: pytest.Config) -> str:
    return f"torch {torch.__version__}, {os.cpu_count()} cpus"
