import os

import pytest
import torch

os.environ.setdefault("PYTHONHASHSEED", "0")
# The config-only HF trace keeps an on-disk cache (~/.cache by default): the suite traces afresh, writing nothing there.
os.environ.setdefault("LIGHTNING_MEMPLAN_HF_TRACE_CACHE", "0")

# Property tests draw fixed examples by default, so CI is reproducible. MEMPLAN_HYPOTHESIS=explore draws
# new ones each run; MEMPLAN_HYPOTHESIS_SCALE=N (read by each test) runs N times as many.
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
    _hyp_settings.register_profile("explore", derandomize=False, deadline=None, print_blob=True)
    _hyp_settings.load_profile(os.environ.get("MEMPLAN_HYPOTHESIS", "ci"))
except ImportError:  # hypothesis is a dev extra; the tests that need it skip without it
    pass


@pytest.fixture
def two_threads():
    """At most two intra-op threads for the test (a real step's allocation order is then that of the
    2-core CI machine), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(min(2, threads))
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
