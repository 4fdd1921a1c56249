"""python -m lab: the whole lab (lab/stages.py)."""

import sys

from lab.stages import main

sys.exit(main())
