import os

import pytest
import torch

# Tests run on CPU with a fixed, small thread count: results must not depend on the machine.
torch.set_num_threads(int(os.environ.get("LOWMEM_TEST_THREADS", "2")))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
