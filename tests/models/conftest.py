import os
import sys

# The shared checkpoint factory lives in tests/ and the test-only backend next to these tests;
# make both importable whatever pytest's import mode.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)
