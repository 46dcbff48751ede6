import sys

from collgrad.cli import main

sys.exit(main())
