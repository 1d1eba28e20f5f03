import os

import pytest
import torch

# Tests are small; one intra-op thread keeps the 2-core CI machine responsive for multi-process tests.
torch.set_num_threads(int(os.environ.get("TITAN_TEST_THREADS", "1")))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the H200 through the device tool")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
