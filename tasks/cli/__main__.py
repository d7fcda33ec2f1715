"""`python -m tasks.cli ...`: the same as the `spotfill` console script."""
from tasks.cli.main import entry

entry()
