"""`python -m colibri_backend ...` is the `colibri` command."""

import sys

from colibri_backend.cli import main

sys.exit(main())
