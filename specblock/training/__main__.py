"""``python -m specblock.training {drafter,target,chatgen,featcache,refanswers,selfask,datastore} ...``"""

import importlib
import sys

from specblock.errors import SpecBlockError

COMMANDS = {"drafter": "specblock.training.drafter", "target": "specblock.training.target",
            "chatgen": "specblock.training.chatgen", "featcache": "specblock.training.featcache",
            "refanswers": "specblock.training.refanswers",
            "selfask": "specblock.training.selfask", "datastore": "specblock.training.datastore"}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m specblock.training {{{','.join(COMMANDS)}}} ... (see --help of each)", file=sys.stderr)
        return 2
    try:
        run = importlib.import_module(COMMANDS[argv[0]]).main
        return run(argv[1:]) or 0
    except SpecBlockError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


sys.exit(main(sys.argv[1:]))
