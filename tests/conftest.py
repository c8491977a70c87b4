"""Shared by unit and integration tests: no test reaches the Hub."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
