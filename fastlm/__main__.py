"""`python -m fastlm ...` (and `torchrun -m fastlm ...`) run the CLI."""

import sys

from fastlm.commands.main import main

sys.exit(main())
