"""Suite-wide settings: the on-disk import memo (`k3c.frontend.cache`) is off, so every test (and every CLI it
starts, which inherits the environment) runs the real importer; tests/frontend/test_import_cache.py turns it on."""

import os

os.environ["K3C_CACHE_DIR"] = "off"
