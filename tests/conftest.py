import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Kernels built during the tests go to a fresh folder (hermetic, and no writable home needed); spawned ranks
# inherit it.
os.environ.setdefault("RLHF_CACHE_DIR", tempfile.mkdtemp(prefix="rlhf-test-cache-"))
