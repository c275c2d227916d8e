"""`python -m pagoda.layers.cpu_kernels`: compile the CPU kernels (what `make install` runs)."""

import sys

from pagoda.layers.cpu_kernels.build import main

sys.exit(main())
