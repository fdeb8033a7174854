import os

# Hypothesis: deterministic, no deadline (shared 2-core CI machines have noisy timing).
from hypothesis import settings

settings.register_profile("epkit", deadline=None, derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("EPKIT_HYPOTHESIS_PROFILE", "epkit"))
