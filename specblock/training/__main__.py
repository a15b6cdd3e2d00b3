"""``python -m specblock.training {drafter,target} ...``"""

import sys

from specblock.errors import SpecBlockError


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("drafter", "target"):
        print("usage: python -m specblock.training {drafter,target} ... (see --help of each)", file=sys.stderr)
        return 2
    try:
        if argv[0] == "drafter":
            from specblock.training.drafter import main as run
        else:
            from specblock.training.target import main as run
        return run(argv[1:]) or 0
    except SpecBlockError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


sys.exit(main(sys.argv[1:]))
