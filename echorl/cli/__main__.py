"""``python -m echorl.cli``: the same as the ``echorl`` console command."""

import sys

from echorl.cli.main import main

sys.exit(main())
