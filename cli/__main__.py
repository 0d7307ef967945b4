"""`python -m unbroken.cli ...` is the `unbroken` console script."""

import sys

from unbroken.cli.main import main

sys.exit(main())
