"""`python -m gendist COMMAND ...` (the commands are `gendist.cli`)."""

import sys

from gendist.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
