"""`python -m clover_jax ARGS` runs the `clover` command (for environments where the script is not on PATH)."""

import sys

from clover_jax.cli import main

sys.exit(main())
