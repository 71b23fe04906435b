"""``python -m vllm_deltasync.cli``."""

import sys

from vllm_deltasync.cli import main

sys.exit(main())
