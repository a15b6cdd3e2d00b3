import sys

from specblock.serve.cli import main

sys.exit(main())
