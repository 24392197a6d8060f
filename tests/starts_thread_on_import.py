"""A module that starts a thread when imported (as a library's background worker would): the fork
server must not preload it (tests/runtime/test_forkserver.py)."""

import threading
import time

threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
