"""``python -m distflow.cli`` = ``distflow`` (:func:`distflow.launch.cli.main`)."""

import sys

from distflow.launch.cli import main

sys.exit(main())
