"""A math-verify worker stand-in that starts, then never answers (tests/unit/test_math_verify_pool.py)."""

import json
import sys
import time

print(json.dumps({"ready": True}), flush=True)
for _line in sys.stdin:
    time.sleep(3600)
