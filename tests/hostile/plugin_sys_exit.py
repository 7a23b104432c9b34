"""A plugin module whose import ends the process (sys.exit(3))."""

import sys

sys.exit(3)
