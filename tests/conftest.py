import os
import sys

# Make `tests.*` importable (the conformance table is shared by several test modules).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
