"""`python -m fastlm ...` (and `torchrun -m fastlm ...`) run the CLI."""

import sys

from fastlm.cli import main

sys.exit(main())
