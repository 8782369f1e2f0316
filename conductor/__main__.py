import sys

from conductor.cli import main

sys.exit(main())
