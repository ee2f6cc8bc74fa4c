"""`python -m loom.dryrun ...`: the dry run before `loom train --dry-run` reaches it (as loom's command line:
a LoomError printed without a traceback, exit 2)."""

import sys

from loom.dryrun.report import dryrun_main
from loom.errors import LoomError

try:
    code = dryrun_main(sys.argv[1:])
except LoomError as e:
    print(f"loom: error: {e}", file=sys.stderr)
    code = 2
sys.exit(code)
