"""Repository root on sys.path for the tests (``from tests.torch_ref import oracle``), also in
pytest-xdist workers."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
