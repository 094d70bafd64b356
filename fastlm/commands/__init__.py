"""The `fastlm` command line, the top floor: `main.py` (the parser and dispatch; the console script and
`python -m fastlm`), then one module per command's work: `train.py` (start checks, the trainer for the run,
torchrun), `validate.py` (also `train --dry-run`), `generate.py`, `convert.py`, `prepare.py`."""
