"""A module that starts a thread when imported: what a worker zygote must refuse to preload."""

from __future__ import annotations

import threading

threading.Thread(target=threading.Event().wait, name="started-at-import", daemon=True).start()
