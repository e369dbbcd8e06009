"""python -m photon.quant: the same as `photon quantize`."""

from __future__ import annotations

import sys

from photon.quant.cli import main

sys.exit(main())
