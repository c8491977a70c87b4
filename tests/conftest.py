"""Shared by unit and integration tests: no test reaches the Hub, and no test teaches the user's later processes
the prices its short requests would leave in tuning's record (FLY_KEEP_PRICES)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("FLY_KEEP_PRICES", "0")
