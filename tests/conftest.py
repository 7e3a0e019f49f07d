"""Test session set-up: offline, and block accounting checked at every engine step."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["LOCKGATE_CHECK_INVARIANTS"] = "1"
