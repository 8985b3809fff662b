"""The example is a project of its own (not a workspace member): its tests import it from `src/`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
