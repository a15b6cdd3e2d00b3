import sys

from specblock import gcstart

gcstart.begin()  # before the heavy imports below (specblock/gcstart.py)

from specblock.runtime.cli import main  # noqa: E402

sys.exit(main())
