"""`python -m specedge.gpu_check [flags]`: the same as `specedge gpu-check [flags]`."""

import sys

from specedge.gpu_check.check import main

sys.exit(main())
