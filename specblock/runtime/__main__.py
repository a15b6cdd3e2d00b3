import sys

from specblock.runtime.cli import main

sys.exit(main())
