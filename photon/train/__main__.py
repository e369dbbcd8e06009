from __future__ import annotations

import sys

from photon.train.cli import main

sys.exit(main())
