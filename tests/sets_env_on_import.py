"""A module that sets an environment variable when imported, as torch._dynamo does (TORCHINDUCTOR_CACHE_DIR)."""

import os

os.environ.setdefault("AUTOFIT_TEST_SET_BY_IMPORT", "yes")
