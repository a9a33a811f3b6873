"""`python -m replay.maxtext RUN <MaxText's train argv>`: see replay/maxtext/__init__.py."""

import sys

from replay.maxtext import main

sys.exit(main())
